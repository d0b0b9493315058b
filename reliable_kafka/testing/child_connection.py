"""How a child process (a lab program, a benchmark variant) gets its clients' connection settings.

In its environment, as JSON, never on its command line: every user of the host can read a command line
(ps), and on a secured cluster the settings carry a password. The one place that writes and reads them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

CONNECTION_ENV = "RK_CONNECTION"

# Where the brokers are and how to log in (bootstrap.servers, security.protocol, sasl.*, ssl.*, ...): what
# every client of a run is given, the controls and baselines included, so both sides reach the same cluster
# the same way.
Connection = Mapping[str, Any]


def connection_of(target: str | Connection) -> dict[str, Any]:
    """The connection settings of `target`: a mapping as given; a bare bootstrap string is an open
    cluster's whole connection."""
    return {"bootstrap.servers": target} if isinstance(target, str) else dict(target)


def child_env(connection: Connection, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: `base` (default: this process's), plus the connection settings."""
    return {**(os.environ if base is None else base), "PYTHONUNBUFFERED": "1",
            CONNECTION_ENV: json.dumps(dict(connection))}


def connection_from_env(bootstrap: str | None = None) -> dict[str, Any]:
    """The connection settings child_env() gave this process; `bootstrap` (a program's --bootstrap, as
    tests start them on an open cluster) names the brokers, over the environment's if both are given."""
    raw = os.environ.get(CONNECTION_ENV, "").strip()
    connection: dict[str, Any] = json.loads(raw) if raw else {}
    if bootstrap is not None:
        connection["bootstrap.servers"] = bootstrap
    if "bootstrap.servers" not in connection:
        raise SystemExit(f"no brokers: {CONNECTION_ENV} is not set and --bootstrap was not given. This program is "
                         "started by `reliable-kafka lab` or `bench`; by hand, pass --bootstrap HOST:PORT (an open "
                         f"cluster) or set {CONNECTION_ENV}='{{\"bootstrap.servers\": \"HOST:PORT\", ...}}'")
    return connection


__all__ = ["CONNECTION_ENV", "Connection", "child_env", "connection_from_env", "connection_of"]
