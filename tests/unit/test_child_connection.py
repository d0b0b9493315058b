"""Child programs (lab programs, benchmark variants) get their connection settings in their environment,
never on their command line, which every user of the host can read."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from reliable_kafka.testing.child_connection import CONNECTION_ENV, child_env, connection_from_env, connection_of

SECRET = "sentinel-" + uuid.uuid4().hex
LOGIN = {"bootstrap.servers": "127.0.0.1:1", "security.protocol": "SASL_SSL", "sasl.username": "admin",
         "sasl.password": SECRET}


def test_the_settings_round_trip_through_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = child_env(LOGIN, base={"PATH": "/bin"})
    assert env["PATH"] == "/bin" and env["PYTHONUNBUFFERED"] == "1"
    monkeypatch.setenv(CONNECTION_ENV, env[CONNECTION_ENV])
    assert connection_from_env() == LOGIN
    # --bootstrap (a program started by hand or by a test) names the brokers; the login stays
    assert connection_from_env("other:2") == {**LOGIN, "bootstrap.servers": "other:2"}


def test_a_program_without_brokers_says_how_to_give_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONNECTION_ENV, raising=False)
    assert connection_from_env("b:1") == {"bootstrap.servers": "b:1"}
    with pytest.raises(SystemExit, match=f"{CONNECTION_ENV} is not set and --bootstrap was not given"):
        connection_from_env()


def test_a_bootstrap_string_is_an_open_clusters_whole_connection() -> None:
    assert connection_of("b:1") == {"bootstrap.servers": "b:1"}
    assert connection_of(LOGIN) == LOGIN and connection_of(LOGIN) is not LOGIN


def test_lab_programs_get_the_login_in_their_environment_not_their_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from reliable_kafka.lab import common

    seen: dict[str, Any] = {}

    class FakePopen:
        def __init__(self, argv: list[str], **kw: Any) -> None:
            seen["argv"], seen["env"] = argv, kw["env"]

    monkeypatch.setattr(common.subprocess, "Popen", FakePopen)
    common.run_program("reliable_kafka.lab.programs.producer_proc", ["--mode", "control", "--topic", "t"], LOGIN)
    assert SECRET not in " ".join(seen["argv"]) and SECRET in seen["env"][CONNECTION_ENV]
