"""The SQLite outbox keeps every appended message until it is delivered or explicitly purged.

Each test counts: the acknowledged set (seqs/ids returned by append) against what a reopened outbox
holds, with crashes (SIGKILL), full disks, corrupt files and competing openers injected for real.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from reliable_kafka.errors import (
    ConfigError,
    OutboxCorrupt,
    OutboxError,
    OutboxFull,
    OutboxLocked,
    SerializationError,
)
from reliable_kafka.ids import new_id
from reliable_kafka.outbox import Outbox
from reliable_kafka.outbox.rows import decode_headers, encode_headers
from reliable_kafka.spool import Durability, NewMessage, OutboxRow
from tests.fixtures.requirements import missing

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]


def messages(n: int, *, size: int = 16, topic: str = "orders") -> list[NewMessage]:
    """`n` messages with unique ids and unique values of `size` bytes (at least 36: the id is inside)."""
    out = []
    for _ in range(n):
        message_id = new_id()
        value = message_id.encode() + os.urandom(max(0, size - 36))
        out.append(NewMessage(message_id=message_id, topic=topic, value=value))
    return out


def ids(rows: Iterable[NewMessage | OutboxRow]) -> list[str]:
    return [row.message_id for row in rows]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_child(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "outbox.db"


# ----------------------------------------------------------------------------- basic lifecycle


def test_append_returns_increasing_seqs_and_pending_keeps_append_order(path: Path) -> None:
    sent = messages(5)
    with Outbox(path) as outbox:
        first = outbox.append(sent[:3])
        second = outbox.append(sent[3:])
        seqs = first + second
        assert seqs == sorted(seqs) and len(set(seqs)) == 5
        rows = outbox.pending()
        assert [r.seq for r in rows] == seqs
        assert ids(rows) == ids(sent)
        assert [r.value for r in rows] == [m.value for m in sent]
        assert all(r.state == "pending" and r.attempts == 0 and r.last_error is None for r in rows)
        assert [r.seq for r in outbox.pending(after_seq=seqs[1], limit=2)] == seqs[2:4]
        assert outbox.append([]) == []


def test_all_fields_round_trip(path: Path) -> None:
    headers = (("rk-id", b"abc"), ("ünïcode", b"\x00\xff"), ("empty", b""), ("rk-id", b"dup"))
    message = NewMessage(new_id(), "payments", b"v", key=b"k", headers=headers, partition=3)
    no_payload = NewMessage(new_id(), "payments", None)
    with Outbox(path) as outbox:
        before_ms = time.time_ns() // 1_000_000
        outbox.append([message, no_payload])
    with Outbox(path) as outbox:
        row, tombstone = outbox.pending()
    assert (row.message_id, row.topic, row.key, row.value) == (message.message_id, "payments", b"k", b"v")
    assert row.headers == headers and row.partition == 3
    assert row.created_ms >= before_ms
    assert (tombstone.key, tombstone.value, tombstone.headers, tombstone.partition) == (None, None, (), None)


def test_header_encoding_is_reversible_and_compact() -> None:
    headers = (("a", b"1"), ("名前", bytes(range(256))), ("z", b""))
    blob = encode_headers(headers)
    assert blob is not None and decode_headers(blob) == headers
    assert len(blob) == sum(6 + len(n.encode()) + len(v) for n, v in headers)
    assert encode_headers(()) is None and decode_headers(None) == ()


def test_mark_delivered_removes_exactly_those_and_ignores_unknown(path: Path) -> None:
    sent = messages(6)
    with Outbox(path) as outbox:
        seqs = outbox.append(sent)
        outbox.mark_delivered([seqs[0], seqs[3], 999_999])
        outbox.mark_delivered([seqs[0]])  # a repeated delivery report
        outbox.mark_delivered([])
        assert [r.seq for r in outbox.pending()] == [seqs[1], seqs[2], seqs[4], seqs[5]]
        assert outbox.stats().pending == 4


def test_failed_messages_stay_until_retried_or_purged(path: Path) -> None:
    sent = messages(5)
    with Outbox(path) as outbox:
        seqs = outbox.append(sent)
        outbox.mark_failed(seqs[1], "MSG_SIZE_TOO_LARGE")
        outbox.mark_failed(seqs[3], "TOPIC_AUTHORIZATION_FAILED")
        outbox.mark_failed(123_456, "unknown seq: logged, nothing changes")
        assert [r.seq for r in outbox.pending()] == [seqs[0], seqs[2], seqs[4]]
        failed = outbox.failed()
        assert [(r.seq, r.state, r.attempts, r.last_error) for r in failed] == [
            (seqs[1], "failed", 1, "MSG_SIZE_TOO_LARGE"),
            (seqs[3], "failed", 1, "TOPIC_AUTHORIZATION_FAILED"),
        ]
        assert [r.seq for r in outbox.failed(limit=1)] == [seqs[1]]
        stats = outbox.stats()
        assert (stats.pending, stats.failed) == (3, 2)

        assert outbox.retry_failed([seqs[3]]) == 1
        assert [r.seq for r in outbox.pending()] == [seqs[0], seqs[2], seqs[3], seqs[4]]  # keeps its seq
        assert outbox.retry_failed([seqs[0]]) == 0  # pending already: not touched

        assert outbox.purge() == 1  # the remaining failed one
        assert outbox.failed() == []
        assert outbox.purge(state="pending", seqs=[seqs[0]]) == 1
        assert [r.seq for r in outbox.pending()] == [seqs[2], seqs[3], seqs[4]]
        assert (outbox.stats().pending, outbox.stats().failed) == (3, 0)
        with pytest.raises(ValueError, match="state"):
            outbox.purge(state="delivered")


def test_retry_all_failed_and_late_delivery_of_a_failed_message(path: Path) -> None:
    with Outbox(path) as outbox:
        seqs = outbox.append(messages(4))
        for seq in seqs[:3]:
            outbox.mark_failed(seq, "UNKNOWN_TOPIC_OR_PART")
        outbox.mark_delivered([seqs[0]])  # its delivery report arrived after all
        assert outbox.stats().failed == 2
        assert outbox.retry_failed() == 2
        assert [r.seq for r in outbox.pending()] == seqs[1:]
        assert (outbox.stats().pending, outbox.stats().failed) == (3, 0)


def test_record_attempt_counts_and_keeps_pending(path: Path) -> None:
    with Outbox(path) as outbox:
        seqs = outbox.append(messages(3))
        outbox.record_attempt(seqs[:2], "_MSG_TIMED_OUT")
        outbox.record_attempt([seqs[0]], "NOT_ENOUGH_REPLICAS")
        rows = {r.seq: r for r in outbox.pending()}
        assert (rows[seqs[0]].attempts, rows[seqs[0]].last_error) == (2, "NOT_ENOUGH_REPLICAS")
        assert (rows[seqs[1]].attempts, rows[seqs[1]].last_error) == (1, "_MSG_TIMED_OUT")
        assert (rows[seqs[2]].attempts, rows[seqs[2]].last_error) == (0, None)
        assert len(rows) == 3


def test_iter_pending_pages_in_order(path: Path) -> None:
    sent = messages(25)
    with Outbox(path) as outbox:
        seqs = outbox.append(sent)
        outbox.mark_failed(seqs[7], "refused")
        walked = []
        for row in outbox.iter_pending(batch=10):
            walked.append(row.seq)
            outbox.mark_delivered([row.seq])  # the spool may change between pages
        assert walked == seqs[:7] + seqs[8:]
        assert outbox.pending() == []


def test_stats(path: Path) -> None:
    with Outbox(path, max_messages=50) as outbox:
        empty = outbox.stats()
        assert (empty.pending, empty.failed, empty.oldest_pending_age_s, empty.max_messages) == (
            0,
            0,
            None,
            50,
        )
        seqs = outbox.append(messages(3))
        time.sleep(0.05)
        outbox.mark_failed(seqs[0], "x")
        stats = outbox.stats()
        assert (stats.pending, stats.failed) == (2, 1)
        assert stats.oldest_pending_age_s is not None and 0.04 <= stats.oldest_pending_age_s < 30
        assert stats.file_bytes > 0


# ----------------------------------------------------------------------------- durability and seqs


def test_seqs_are_never_reused_after_deletes_and_reopen(path: Path) -> None:
    with Outbox(path) as outbox:
        seqs = outbox.append(messages(5))
        outbox.mark_delivered(seqs)  # the highest seq is gone too
    with Outbox(path) as outbox:
        again = outbox.append(messages(2))
    assert again[0] > seqs[-1]
    assert again == [again[0], again[0] + 1]


@pytest.mark.parametrize("durability", ["process", "fsync", Durability.FSYNC])
def test_rows_survive_close_and_reopen(path: Path, durability: str) -> None:
    sent = messages(10)
    with Outbox(path, durability=durability) as outbox:
        assert outbox.durability in (Durability.PROCESS, Durability.FSYNC)
        seqs = outbox.append(sent)
        outbox.mark_delivered(seqs[:4])
        outbox.mark_failed(seqs[4], "refused")
    with Outbox(path, durability=durability) as outbox:
        assert ids(outbox.pending()) == ids(sent[5:])
        assert ids(outbox.failed()) == [sent[4].message_id]
        assert (outbox.stats().pending, outbox.stats().failed) == (5, 1)


def test_fsync_syncs_every_commit_but_the_removal_of_delivered_messages(path: Path) -> None:
    """In "fsync" an append, a failure and a retry each commit with synchronous=FULL; removing delivered
    messages commits with NORMAL (a power cut may bring them back, to be sent again: a duplicate, never a
    loss), and FULL is back for the next transaction."""
    def synchronous(conn: sqlite3.Connection) -> int:
        return int(conn.execute("PRAGMA synchronous").fetchone()[0])

    with Outbox(path, durability="fsync") as outbox:
        conn = outbox._file.conn
        seen: list[tuple[str, int]] = []
        traced: list[str] = []
        conn.set_trace_callback(traced.append)

        def note(what: str) -> None:
            # Each statement as it runs; the setting in force is read after each transaction.
            seen.append((what, synchronous(conn)))

        seqs = outbox.append(messages(6))
        note("append")
        outbox.mark_delivered(seqs[:3])
        note("mark_delivered")
        outbox.mark_failed(seqs[3], "refused")
        note("mark_failed")
        assert outbox.retry_failed() == 1
        note("retry_failed")
        conn.set_trace_callback(None)
    assert [level for _, level in seen] == [2, 2, 2, 2], seen  # FULL between transactions
    # The one transaction that ran relaxed: the removal, between its two pragmas.
    relaxed = [i for i, sql in enumerate(traced) if sql == "PRAGMA synchronous=NORMAL"]
    assert len(relaxed) == 1, traced
    i = relaxed[0]
    assert traced[i + 1] == "BEGIN IMMEDIATE"
    assert any(sql.startswith("DELETE") for sql in traced[i + 2:traced.index("COMMIT", i)])
    assert traced[traced.index("COMMIT", i) + 1] == "PRAGMA synchronous=FULL"


def test_process_durability_never_switches_synchronous(path: Path) -> None:
    with Outbox(path, durability="process", journal=False) as outbox:
        traced: list[str] = []
        outbox._file.conn.set_trace_callback(traced.append)
        outbox.mark_delivered(outbox.append(messages(3)))
        outbox._file.conn.set_trace_callback(None)
    assert not [sql for sql in traced if "synchronous" in sql], traced


@pytest.mark.parametrize("durability", ["process", "fsync"])
def test_every_acknowledged_append_survives_sigkill(path: Path, durability: str) -> None:
    child = """
        import os, signal, sys
        from reliable_kafka.ids import new_id
        from reliable_kafka.outbox import Outbox
        from reliable_kafka.spool import NewMessage
        outbox = Outbox(sys.argv[1], durability=sys.argv[2])
        for batch_no in range(20):
            batch = [NewMessage(new_id(), "t", os.urandom(100)) for _ in range(50)]
            seqs = outbox.append(batch)
            # acknowledged only now that append() has returned
            print(" ".join(f"{s}:{m.message_id}" for s, m in zip(seqs, batch)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
    result = run_child(child, str(path), durability)
    assert result.returncode == -signal.SIGKILL, result.stderr
    acked = dict(token.split(":") for token in result.stdout.split())
    assert len(acked) == 1000
    with Outbox(path, durability=durability) as outbox:  # the dead child's flock is gone with it
        stored = {str(r.seq): r.message_id for r in outbox.pending()}
    lost = set(acked.items()) - set(stored.items())
    assert not lost
    assert stored == acked  # and nothing else appeared


def test_half_created_outbox_is_initialised(path: Path) -> None:
    # A crash during first creation leaves a SQLite file without tables; it holds no messages.
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=wal")
    conn.close()
    with Outbox(path) as outbox:
        assert len(outbox.append(messages(2))) == 2


# ----------------------------------------------------------------------------- the bound


def test_append_blocks_at_the_bound_then_raises_full(path: Path) -> None:
    with Outbox(path, max_messages=10) as outbox:
        outbox.append(messages(10))
        started = time.monotonic()
        with pytest.raises(OutboxFull, match="stayed full"):
            outbox.append(messages(1), timeout=0.3)
        assert time.monotonic() - started >= 0.3
        assert outbox.stats().pending == 10


def test_batch_larger_than_the_bound_fails_at_once(path: Path) -> None:
    with Outbox(path, max_messages=10, max_bytes=10_000) as outbox:
        started = time.monotonic()
        with pytest.raises(OutboxFull, match="can never fit"):
            outbox.append(messages(11), timeout=10)
        with pytest.raises(OutboxFull, match="can never fit"):
            outbox.append(messages(1, size=10_001), timeout=10)
        assert time.monotonic() - started < 5
        assert outbox.pending() == []


def test_mark_delivered_unblocks_a_waiting_append(path: Path) -> None:
    sent = messages(10)
    with Outbox(path, max_messages=10) as outbox:
        seqs = outbox.append(sent)
        waiting = messages(3)
        result: queue.Queue[list[int] | BaseException] = queue.Queue()

        def send() -> None:
            try:
                result.put(outbox.append(waiting, timeout=10))
            except BaseException as exc:
                result.put(exc)

        thread = threading.Thread(target=send)
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive() and result.empty()  # blocked, not dropped
        outbox.mark_delivered(seqs[:2])
        time.sleep(0.2)
        assert thread.is_alive()  # two slots are not enough for three
        outbox.mark_delivered(seqs[2:3])
        thread.join(5)
        appended = result.get_nowait()
        assert isinstance(appended, list) and appended[0] > seqs[-1]
        assert ids(outbox.pending()) == ids(sent[3:]) + ids(waiting)


def test_failed_rows_count_against_the_bound_and_purge_makes_room(path: Path) -> None:
    with Outbox(path, max_messages=4) as outbox:
        for seq in outbox.append(messages(4)):
            outbox.mark_failed(seq, "refused")
        with pytest.raises(OutboxFull):
            outbox.append(messages(1), timeout=0)
        timer = threading.Timer(0.2, outbox.purge)
        timer.start()
        assert len(outbox.append(messages(2), timeout=10)) == 2
        timer.join()


def test_byte_bound(path: Path) -> None:
    with Outbox(path, max_messages=1000, max_bytes=1000) as outbox:
        seqs = outbox.append(messages(9, size=100))
        with pytest.raises(OutboxFull):
            outbox.append(messages(2, size=100), timeout=0)
        outbox.mark_delivered(seqs[:1])
        outbox.append(messages(2, size=100), timeout=0)
        with pytest.raises(OutboxFull):
            outbox.append(messages(1, size=1), timeout=0)
    # The byte total is rebuilt on open.
    with Outbox(path, max_messages=1000, max_bytes=1000) as outbox, pytest.raises(OutboxFull):
        outbox.append(messages(1, size=1), timeout=0)


def test_close_fails_a_waiting_append(path: Path) -> None:
    outbox = Outbox(path, max_messages=1)
    outbox.append(messages(1))
    errors: list[BaseException] = []

    def send() -> None:
        try:
            outbox.append(messages(1), timeout=10)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    time.sleep(0.2)
    outbox.close()
    thread.join(5)
    assert len(errors) == 1 and type(errors[0]) is OutboxError and "closed" in str(errors[0])
    with pytest.raises(OutboxError, match="closed"):
        outbox.append(messages(1))
    outbox.close()  # idempotent


def test_concurrent_appenders_and_a_delivering_poller(path: Path) -> None:
    acked: queue.Queue[int] = queue.Queue()
    with Outbox(path, max_messages=200) as outbox:

        def produce() -> None:
            for _ in range(30):
                for seq in outbox.append(messages(10), timeout=20):
                    acked.put(seq)

        producers = [threading.Thread(target=produce) for _ in range(4)]
        for t in producers:
            t.start()
        delivered: list[int] = []
        deadline = time.monotonic() + 30
        while len(delivered) < 1200 and time.monotonic() < deadline:
            batch: list[int] = []
            with contextlib.suppress(queue.Empty):
                while len(batch) < 50:
                    batch.append(acked.get(timeout=0.05))
            outbox.mark_delivered(batch)
            delivered += batch
        for t in producers:
            t.join(5)
        assert len(delivered) == len(set(delivered)) == 1200
        assert outbox.pending() == [] and outbox.stats().pending == 0


# ----------------------------------------------------------------------------- bad input


def test_a_message_id_may_be_spooled_again(path: Path) -> None:
    """A re-sent message keeps its rk-id: the outbox stores it again instead of refusing it."""
    first = messages(2)
    with Outbox(path) as outbox:
        outbox.append(first)
        outbox.append([first[1]])
        assert ids(outbox.pending()) == ids(first) + [first[1].message_id]
        assert outbox.stats().pending == 3


@pytest.mark.parametrize(
    "bad",
    [
        NewMessage("id-1", "t", "not bytes"),  # type: ignore[arg-type]
        NewMessage("id-1", "t", b"v", key=123),  # type: ignore[arg-type]
        NewMessage("id-1", "t", b"v", headers=(("h", "str value"),)),  # type: ignore[arg-type]
        NewMessage("id-1", "t", b"v", headers=((b"bytes name", b"v"),)),  # type: ignore[arg-type]
    ],
)
def test_non_bytes_payload_is_refused(path: Path, bad: NewMessage) -> None:
    with Outbox(path) as outbox:
        with pytest.raises(SerializationError, match="id-1"):
            outbox.append(messages(1) + [bad])
        assert outbox.pending() == []


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"durability": "memory"}, "durability"),
        ({"durability": Durability.MEMORY}, "durability"),
        ({"durability": "sometimes"}, "durability"),
        ({"max_messages": 0}, "max_messages"),
        ({"max_bytes": 0}, "max_bytes"),
    ],
)
def test_invalid_settings_are_refused(path: Path, kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Outbox(path, **kwargs)  # type: ignore[arg-type]
    assert info.value.key == key
    assert not path.exists()


# ----------------------------------------------------------------------------- one owner


def test_second_opener_in_the_same_process_is_locked_out(path: Path) -> None:
    with Outbox(path) as outbox:
        outbox.append(messages(1))
        with pytest.raises(OutboxLocked, match=rf"pid {os.getpid()}\b") as info:
            Outbox(path)
        assert str(path) in str(info.value)
        assert outbox.stats().pending == 1  # the owner is unaffected
    with Outbox(path) as again:  # released on close
        assert again.stats().pending == 1


def test_child_process_is_locked_out_while_we_own_it(path: Path) -> None:
    child = """
        import sys
        from reliable_kafka.outbox import Outbox
        try:
            Outbox(sys.argv[1])
        except Exception as exc:
            print(type(exc).__name__, exc)
    """
    with Outbox(path):
        result = run_child(child, str(path))
    assert result.stdout.startswith("OutboxLocked"), result.stdout + result.stderr
    assert f"pid {os.getpid()}" in result.stdout


def test_we_are_locked_out_while_a_child_owns_it(path: Path) -> None:
    child = """
        import sys
        from reliable_kafka.outbox import Outbox
        with Outbox(sys.argv[1]):
            print("owned", flush=True)
            sys.stdin.read()
    """
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(child), str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "owned"
        with pytest.raises(OutboxLocked, match=rf"pid {proc.pid}\b"):
            Outbox(path)
    finally:
        proc.communicate(input="", timeout=20)
    with Outbox(path) as outbox:
        assert outbox.pending() == []


# ----------------------------------------------------------------------------- corrupt files


def _random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def _truncated_outbox(path: Path) -> None:
    with Outbox(path) as outbox:
        outbox.append(messages(2000, size=200))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _damaged_table_page(path: Path) -> None:
    # The schema and the header stay readable, so only SQLite's own integrity check can notice.
    with Outbox(path) as outbox:
        outbox.append(messages(2000, size=200))
    conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE type = 'table' AND name = 'messages'").fetchone()
    (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    conn.close()
    with open(path, "r+b") as fh:
        fh.seek((root - 1) * page_size)
        fh.write(os.urandom(page_size))


def _foreign_sqlite(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO users (name) VALUES ('ada')")
    conn.commit()
    conn.close()


def _outbox_without_marker(path: Path) -> None:
    with Outbox(path) as outbox:
        outbox.append(messages(3))
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM meta WHERE key = 'format'")
    conn.commit()
    conn.close()


@pytest.mark.parametrize(
    "make", [_random_bytes, _truncated_outbox, _damaged_table_page, _foreign_sqlite, _outbox_without_marker]
)
@pytest.mark.parametrize("read_only", [False, True])
def test_corrupt_file_is_refused_and_left_untouched(
    path: Path, make: Callable[[Path], None], read_only: bool
) -> None:
    make(path)
    before = digest(path)
    files_before = set(os.listdir(path.parent)) - {path.name + ".lock"}
    with pytest.raises(OutboxCorrupt) as info:
        Outbox(path, read_only=read_only)
    assert str(path) in str(info.value) and "left exactly as it is" in str(info.value)
    assert digest(path) == before
    assert set(os.listdir(path.parent)) - {path.name + ".lock"} == files_before  # no -wal/-shm made
    with pytest.raises(OutboxCorrupt):  # and it stays refused: nothing was "repaired"
        Outbox(path, read_only=read_only)
    assert digest(path) == before


def test_newer_schema_version_is_refused_but_not_called_corrupt(path: Path) -> None:
    with Outbox(path) as outbox:
        outbox.append(messages(1))
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(OutboxError, match="schema version 99") as info:
        Outbox(path)
    assert not isinstance(info.value, OutboxCorrupt)


# ----------------------------------------------------------------------------- full disk / read-only file


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path | None]:
    """A 1 MiB tmpfs, or None where mounting is not permitted."""
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        yield None
        return
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        capture_output=True,
        timeout=10,
    )
    if mounted.returncode != 0:
        yield None
        return
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=10).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=10)


def test_full_disk_raises_a_clear_error_and_writes_nothing_half(tiny_fs: Path | None, tmp_path: Path) -> None:
    if tiny_fs is None:
        _read_only_file_is_refused(tmp_path)
        return
    path = tiny_fs / "outbox.db"
    ballast = tiny_fs / "ballast"
    ballast.write_bytes(b"\0" * 200_000)  # freed later to show the outbox recovers
    outbox = Outbox(path)
    acked: list[str] = []
    try:
        error: OutboxError | None = None
        rejected: list[NewMessage] = []
        for _ in range(200):  # bounded: 1 MiB is full long before 200 batches of 20 KB
            batch = messages(20, size=1000)
            try:
                outbox.append(batch)
            except OutboxError as exc:
                error, rejected = exc, batch
                break
            acked += ids(batch)
        assert error is not None and acked, "the 1 MiB filesystem never filled up"
        assert not isinstance(error, (OutboxFull, OutboxCorrupt))
        assert str(path) in str(error) and "full" in str(error) and "nothing was written" in str(error)
        assert ids(outbox.pending()) == acked  # every acked row, none of the rejected batch
        assert outbox.stats().pending == len(acked)

        ballast.unlink()
        outbox.append(rejected)  # space again: the same outbox keeps working
        acked += ids(rejected)
    finally:
        outbox.close()
    with Outbox(path) as reopened:
        assert ids(reopened.pending()) == acked


def _read_only_file_is_refused(tmp_path: Path) -> None:
    """Fallback where tmpfs cannot be mounted: a read-only outbox file must fail just as clearly."""
    path = tmp_path / "outbox.db"
    with Outbox(path) as outbox:
        outbox.append(messages(3))
    path.chmod(0o444)
    before = digest(path)
    try:
        if os.access(path, os.W_OK):
            missing(
                "a way to make the outbox unwritable",
                "mounting a tmpfs was refused and this user ignores file permissions (root): run the "
                "tests as root with CAP_SYS_ADMIN (mount) or as an unprivileged user",
            )
        with pytest.raises(OutboxError, match="read-only") as info:
            Outbox(path).append(messages(1))
        assert str(path) in str(info.value)
        assert digest(path) == before
    finally:
        path.chmod(0o644)


# ----------------------------------------------------------------------------- read-only viewers


def test_read_only_of_a_missing_file(path: Path) -> None:
    with pytest.raises(OutboxError, match="no such outbox"):
        Outbox(path, read_only=True)
    assert not path.exists()


def test_read_only_viewer_sees_a_live_owner_and_refuses_writes(path: Path) -> None:
    with Outbox(path) as owner:
        seqs = owner.append(messages(3))
        owner.mark_failed(seqs[0], "refused")
        with Outbox(path, read_only=True) as viewer:  # takes no lock
            assert (viewer.stats().pending, viewer.stats().failed) == (2, 1)
            assert [r.seq for r in viewer.failed()] == [seqs[0]]
            owner.append(messages(2))
            assert viewer.stats().pending == 4  # counted afresh, not cached
            assert len(viewer.pending()) == 4
            writes = [
                lambda: viewer.append(messages(1)),
                lambda: viewer.mark_delivered(seqs),
                lambda: viewer.mark_failed(seqs[1], "x"),
                lambda: viewer.record_attempt(seqs, "x"),
                lambda: viewer.retry_failed(),
                lambda: viewer.purge(),
            ]
            for write in writes:
                with pytest.raises(OutboxError, match="read-only"):
                    write()
        assert (owner.stats().pending, owner.stats().failed) == (4, 1)


# ----------------------------------------------------------------------------- model-based


class OutboxModel(RuleBasedStateMachine):
    """Random appends, deliveries, failures, retries, purges and reopens against a plain dict model.

    Appends of 8 or more plain messages become one batch row: the model knows that the messages of a
    batch confirmed before a reopen come back as pending (the batch row goes only when all are in), and
    that a failure inside a batch gives its messages rows of their own (confirmed ones stay gone).
    """

    BOUND = 30

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-model-"))
        self.path = self.dir / "outbox.db"
        self.outbox = Outbox(self.path, max_messages=self.BOUND)
        self.model: dict[int, tuple[str, str]] = {}  # seq -> (message_id, state)
        self.highest_seq = 0
        # first seq of each live batch row -> {seq: message_id} of all its messages, and the delivered ones
        self.batches: dict[int, dict[int, str]] = {}
        self.delivered_in: dict[int, set[int]] = {}

    def _batch_of(self, seq: int) -> int | None:
        return next((first for first, members in self.batches.items() if seq in members), None)

    def _batch_gone(self, first: int) -> None:
        del self.batches[first]
        del self.delivered_in[first]

    def _seqs(self, state: str) -> list[int]:
        return sorted(seq for seq, (_, s) in self.model.items() if s == state)

    @rule(n=st.integers(min_value=1, max_value=10))
    def append(self, n: int) -> None:
        batch = messages(n)
        if len(self.model) + n > self.BOUND:
            with pytest.raises(OutboxFull):
                self.outbox.append(batch, timeout=0)
            return
        seqs = self.outbox.append(batch, timeout=0)
        assert seqs == list(range(seqs[0], seqs[0] + n)) and seqs[0] > self.highest_seq
        self.highest_seq = seqs[-1]
        for seq, message in zip(seqs, batch, strict=True):
            self.model[seq] = (message.message_id, "pending")
        if n >= 8:
            self.batches[seqs[0]] = {seq: m.message_id for seq, m in zip(seqs, batch, strict=True)}
            self.delivered_in[seqs[0]] = set()

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=5))
        self.outbox.mark_delivered([*chosen, self.highest_seq + 1000])
        for seq in chosen:
            self.model.pop(seq, None)
            first = self._batch_of(seq)
            if first is not None:
                self.delivered_in[first].add(seq)
                if len(self.delivered_in[first]) == len(self.batches[first]):
                    self._batch_gone(first)

    @precondition(lambda self: bool(self._seqs("pending")))
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self._seqs("pending")))
        self.outbox.mark_failed(seq, "refused")
        self.model[seq] = (self.model[seq][0], "failed")
        first = self._batch_of(seq)
        if first is not None:
            self._batch_gone(first)

    @rule(data=st.data(), everything=st.booleans())
    def retry(self, data: st.DataObject, everything: bool) -> None:
        failed = self._seqs("failed")
        chosen = failed if everything else data.draw(st.lists(st.sampled_from(failed or [0]), max_size=3))
        moved = self.outbox.retry_failed(None if everything else chosen)
        assert moved == len(set(chosen) & set(failed))
        for seq in set(chosen) & set(failed):
            self.model[seq] = (self.model[seq][0], "pending")

    @precondition(lambda self: bool(self._seqs("failed")))
    @rule()
    def purge_failed(self) -> None:
        assert self.outbox.purge() == len(self._seqs("failed"))
        for seq in self._seqs("failed"):
            del self.model[seq]

    @rule()
    def reopen(self) -> None:
        self.outbox.close()
        self.outbox = Outbox(self.path, max_messages=self.BOUND)
        for first, members in self.batches.items():
            for seq in self.delivered_in[first]:
                self.model[seq] = (members[seq], "pending")
            self.delivered_in[first] = set()

    @invariant()
    def matches_model(self) -> None:
        pending = self.outbox.pending()
        assert [r.seq for r in pending] == self._seqs("pending")
        assert [r.message_id for r in pending] == [self.model[s][0] for s in self._seqs("pending")]
        assert [r.seq for r in self.outbox.failed()] == self._seqs("failed")
        stats = self.outbox.stats()
        assert (stats.pending, stats.failed) == (len(self._seqs("pending")), len(self._seqs("failed")))

    def teardown(self) -> None:
        self.outbox.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestOutboxModel = OutboxModel.TestCase
TestOutboxModel.settings = settings(
    max_examples=30,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---- batch rows: a send_many() of plain messages is one row --------------------------------------


def _table_counts(path: Path) -> tuple[int, int]:
    conn = sqlite3.connect(path)
    try:
        return (conn.execute("SELECT count(*) FROM messages").fetchone()[0],
                conn.execute("SELECT count(*) FROM batches").fetchone()[0])
    finally:
        conn.close()


def test_a_batch_of_plain_messages_is_one_row_and_reads_back_in_order_with_single_rows(path: Path) -> None:
    keyed = NewMessage(new_id(), "orders", b"with a key", key=b"k")
    with Outbox(path) as outbox:
        first = outbox.append(messages(10))
        single = outbox.append([keyed])
        second = outbox.append(messages(8, topic="refunds"))
        small = outbox.append(messages(3))  # below the batch size: rows of their own
        assert first + single + second + small == list(range(first[0], first[0] + 22))
        rows = outbox.pending()
        assert [r.seq for r in rows] == first + single + second + small
        assert rows[10].key == b"k" and rows[11].topic == "refunds" and rows[0].topic == "orders"
        # Pages that start and end inside batches, as the producer's re-send reads them.
        assert [r.seq for r in outbox.pending(after_seq=first[4], limit=9)] == first[5:] + single + second[:3]
        assert [r.seq for r in outbox.iter_pending(batch=4)] == first + single + second + small
        assert outbox.get(second[2]) == rows[13]
        assert outbox.get(first[-1] + 100) is None
    # Two batch rows and four message rows (the small appends were journal records until the close).
    assert _table_counts(path) == (4, 2)
    # Seqs keep growing after a reopen, for rows and batches alike.
    with Outbox(path) as outbox:
        later = outbox.append(messages(1)) + outbox.append(messages(9))
        assert later[0] == small[-1] + 1 and later == list(range(later[0], later[0] + 10))


def test_a_batch_row_goes_when_all_its_messages_are_confirmed(path: Path) -> None:
    with Outbox(path) as outbox:
        seqs = outbox.append(messages(10, size=50))
        outbox.mark_delivered(seqs[:4] + seqs[6:])
        assert [r.seq for r in outbox.pending()] == seqs[4:6]
        assert outbox.stats().pending == 2 and outbox.get(seqs[0]) is None
        assert _table_counts(path) == (0, 1)
        outbox.mark_delivered(seqs[4:6] + seqs[4:6])  # a repeated report changes nothing
        assert outbox.stats().pending == 0 and outbox.pending() == []
        assert _table_counts(path) == (0, 0)


def test_after_a_crash_a_partly_confirmed_batch_is_pending_whole(path: Path) -> None:
    # What was confirmed of a batch is kept in memory only: after a restart it is sent again, with the
    # same rk-ids, so a dedup store recognises the copies. Nothing is lost.
    sent = messages(10)
    with Outbox(path) as outbox:
        seqs = outbox.append(sent)
        outbox.mark_delivered(seqs[:7])
    with Outbox(path) as outbox:
        assert ids(outbox.pending()) == ids(sent)
        assert outbox.stats().pending == 10


def test_a_failure_inside_a_batch_parks_that_message_and_keeps_the_rest_pending(path: Path) -> None:
    sent = messages(10)
    with Outbox(path) as outbox:
        seqs = outbox.append(sent)
        outbox.mark_delivered(seqs[:2])
        outbox.record_attempt([seqs[3]], "_MSG_TIMED_OUT")
        assert _table_counts(path) == (8, 0)  # the undelivered 8 have rows of their own now
        outbox.mark_failed(seqs[5], "MSG_SIZE_TOO_LARGE")
        assert [(r.seq, r.attempts, r.last_error) for r in outbox.failed()] == [(seqs[5], 1, "MSG_SIZE_TOO_LARGE")]
        pending = outbox.pending()
        assert [r.seq for r in pending] == seqs[2:5] + seqs[6:]
        assert (pending[1].attempts, pending[1].last_error) == (1, "_MSG_TIMED_OUT")
        assert [r.value for r in pending] == [m.value for m in sent[2:5] + sent[6:]]
        assert (outbox.stats().pending, outbox.stats().failed) == (7, 1)
    with Outbox(path) as outbox:  # confirmed messages of the old batch stay gone
        assert [r.seq for r in outbox.pending()] == seqs[2:5] + seqs[6:]


def test_purging_pending_messages_covers_batch_rows(path: Path) -> None:
    with Outbox(path) as outbox:
        a = outbox.append(messages(10))
        b = outbox.append(messages(9))
        outbox.mark_delivered(a[:1])
        assert outbox.purge(state="pending", seqs=[a[1], b[0], b[1]]) == 3
        assert [r.seq for r in outbox.pending()] == a[2:] + b[2:]
        assert outbox.purge(state="pending") == 15
        assert outbox.pending() == [] and outbox.stats().pending == 0
        assert _table_counts(path) == (0, 0)


def test_ids_with_a_newline_are_spooled_row_by_row(path: Path) -> None:
    odd = [NewMessage(f"caller-id\n{i}", "orders", b"v") for i in range(9)]
    with Outbox(path) as outbox:
        outbox.append(odd)
        assert _table_counts(path) == (9, 0)
        assert ids(outbox.pending()) == ids(odd)


def test_a_read_only_viewer_sees_batch_rows(path: Path) -> None:
    with Outbox(path) as outbox:
        seqs = outbox.append(messages(12))
        with Outbox(path, read_only=True) as viewer:
            assert [r.seq for r in viewer.pending()] == seqs
            assert viewer.stats().pending == 12 and viewer.get(seqs[3]) is not None
            outbox.mark_delivered(seqs)
            assert viewer.pending() == [] and viewer.stats().pending == 0


def test_a_version_1_outbox_is_read_and_upgraded_by_its_next_owner(path: Path) -> None:
    sent = messages(3)
    with Outbox(path) as outbox:
        outbox.append(sent)
    conn = sqlite3.connect(path)
    conn.execute("DROP TABLE batches")
    conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with Outbox(path, read_only=True) as viewer:
        assert ids(viewer.pending()) == ids(sent)
    with Outbox(path) as outbox:
        assert ids(outbox.pending()) == ids(sent)
        outbox.append(messages(8))
        assert _table_counts(path) == (3, 1)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "2"
    conn.close()
