"""Entry point of the `reliable-kafka` command: checks that the cli extra is installed, then runs it.

Nothing here imports click or rich at module level, so a missing extra is one line on stderr and exit
code 2 (a usage error, as click reports its own), never a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

from reliable_kafka.errors import MissingExtra
from reliable_kafka.extras import needs_extra

_WHAT = "reliable-kafka's command line"


def main() -> None:
    try:
        with needs_extra("cli", _WHAT):
            from reliable_kafka.cli.app import cli
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    cli(prog_name="reliable-kafka")


def __getattr__(name: str) -> Any:
    # `from reliable_kafka.cli.main import cli` keeps working for tests and embedders (they have the extra).
    if name == "cli":
        from reliable_kafka.cli.app import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
