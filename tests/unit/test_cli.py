"""The command line's contract for bad input: a clear message and a non-zero exit code, fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from reliable_kafka.cli.main import cli
from reliable_kafka.outbox import Outbox
from reliable_kafka.spool import NewMessage


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.output


def test_unknown_lab_scenario_is_refused_with_the_known_names() -> None:
    code, out = run("lab", "no-such-scenario")
    assert code == 2
    assert "unknown scenario" in out and "acks1-leader-loss" in out


def test_unwritable_json_path_is_refused_before_any_work(tmp_path: Path) -> None:
    code, out = run("lab", "acks1-leader-loss", "--json", str(tmp_path / "missing-dir" / "x.json"))
    assert code == 1
    assert "does not exist" in out


def test_lab_refuses_a_cluster_it_cannot_break(tmp_path: Path) -> None:
    code, out = run("lab", "acks1-leader-loss", "--bootstrap-servers", "127.0.0.1:1",
                    "--state-file", str(tmp_path / "none.json"))
    assert code == 4  # no cluster to break: not 1, which means only that reliable_kafka lost something
    assert "reliable-kafka cluster start" in out


@pytest.mark.waits  # doctor's 10 s of librdkafka timeouts against no broker
def test_doctor_on_unreachable_brokers_fails_clearly() -> None:
    code, out = run("doctor", "--bootstrap-servers", "127.0.0.1:1")
    assert code == 1
    assert "cannot audit 127.0.0.1:1" in out


def test_outbox_commands_show_retry_and_purge_failed_messages(tmp_path: Path) -> None:
    path = tmp_path / "o.db"
    with Outbox(path) as ob:
        seqs = ob.append([NewMessage("id-1", "t", b"a"), NewMessage("id-2", "t", b"b")])
        ob.mark_failed(seqs[1], "MSG_SIZE_TOO_LARGE: Broker: Message size too large")
    code, out = run("outbox", "status", "--path", str(path), "--json")
    assert code == 0 and json.loads(out)["pending"] == 1 and json.loads(out)["failed"] == 1
    code, out = run("outbox", "list-failed", "--path", str(path), "--json")
    assert json.loads(out)["failed"][0]["reason"].startswith("MSG_SIZE_TOO_LARGE")
    code, out = run("outbox", "retry-failed", "--path", str(path))
    assert code == 0 and "1 message(s) back to pending" in out
    with Outbox(path) as ob:
        ob.mark_failed(seqs[1], "again")
    code, out = run("outbox", "purge", "--path", str(path), "--yes")
    assert code == 0 and "1 failed message(s) purged" in out
    with Outbox(path, read_only=True) as ob:
        assert ob.stats().pending == 1 and ob.stats().failed == 0


def test_outbox_command_on_a_missing_or_corrupt_file(tmp_path: Path) -> None:
    code, out = run("outbox", "status", "--path", str(tmp_path / "nope.db"))
    assert code == 1 and "no outbox" in out
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"not a database at all" * 100)
    code, out = run("outbox", "status", "--path", str(bad))
    assert code == 1 and "bad.db" in out
