"""The outbox's accept journal: a single append survives a SIGKILL without a transaction, and nothing else.

Each crash test counts the acknowledged set (what append() returned before the kill, written by the
child as it went) against what a reopened outbox holds, and what was marked delivered against what
comes back (it must not).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

import reliable_kafka.outbox.front as outbox_front
from reliable_kafka.errors import OutboxError, OutboxFull, SerializationError
from reliable_kafka.ids import new_id
from reliable_kafka.outbox import Outbox
from reliable_kafka.outbox.journal import AcceptJournal, read_journal, segment_paths
from reliable_kafka.outbox.pool import OutboxPool, pool_status
from reliable_kafka.spool import NewMessage

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]


def one(value: bytes, **kw: object) -> list[NewMessage]:
    return [NewMessage(new_id(), "orders", value, **kw)]  # type: ignore[arg-type]


# A child that appends single messages (the journal path, by append_one() and by append()), records
# each acknowledged seq and value, marks every third one delivered, and SIGKILLs itself mid-stream:
# no close(), no settle.
_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    from reliable_kafka.ids import new_id
    from reliable_kafka.outbox import Outbox
    from reliable_kafka.spool import NewMessage
    path, ledger, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    box = Outbox(path)
    assert box.journaled
    with open(ledger, "w", buffering=1) as out:
        for i in range(n):
            value = f"v-{i}".encode()
            m = NewMessage(new_id(), "orders", value, key=b"k" if i % 5 == 0 else None,
                           headers=(("h", b"x"),) if i % 7 == 0 else ())
            seq = box.append_one(m) if i % 2 else box.append([m])[0]  # send()'s path and send_many()'s
            delivered = i % 3 == 0
            if delivered:
                box.mark_delivered([seq])
            out.write(json.dumps([seq, value.decode(), delivered]) + "\\n")
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _killed_child(tmp_path: Path, n: int) -> tuple[Path, list[tuple[int, str, bool]]]:
    path, ledger = tmp_path / "outbox.db", tmp_path / "ledger"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(ledger), str(n)], cwd=REPO_ROOT,
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    acked = [tuple(json.loads(line)) for line in ledger.read_text().splitlines()]
    assert len(acked) == n
    return path, acked  # type: ignore[return-value]


def test_single_appends_survive_a_sigkill_and_delivered_ones_stay_gone(tmp_path: Path) -> None:
    path, acked = _killed_child(tmp_path, 3_000)
    assert segment_paths(path), "the killed run left its journal"
    undelivered = {value for _, value, delivered in acked if not delivered}
    # A viewer (outbox status, the pool's scan for slots to adopt) counts the journal's messages.
    with Outbox(path, read_only=True) as viewer:
        assert viewer.stats().pending == len(undelivered)
        assert {r.value.decode() for r in viewer.pending()} == undelivered
    with Outbox(path) as box:  # the owner's open settles the journal into rows and deletes it
        rows = box.pending()
        assert {r.value.decode() for r in rows} == undelivered  # lost: none; delivered ones: not back
        assert [r.seq for r in rows] == sorted(seq for seq, _, delivered in acked if not delivered)
        by_value = {r.value: r for r in rows}
        assert by_value[b"v-5"].key == b"k" and by_value[b"v-7"].headers == (("h", b"x"),)
        assert not segment_paths(path)
        later = box.append(one(b"after"))
        assert later[0] > max(seq for seq, _, _ in acked)  # seqs are never handed out twice
    with Outbox(path) as box:
        assert box.stats().pending == len(undelivered) + 1


def test_a_dead_slot_holding_only_journal_records_is_adopted(tmp_path: Path) -> None:
    """The pool adopts a slot by its pending count: a message only in the journal must not be stranded."""
    pool_dir = tmp_path / "pool"
    pool_dir.mkdir()
    slot = OutboxPool(pool_dir).claim(durability="process", max_messages=1_000)  # type: ignore[arg-type]
    slot_path = slot.path
    slot.close()
    ledger = tmp_path / "ledger"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(slot_path), str(ledger), "50"], cwd=REPO_ROOT,
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    expected = sum(1 for line in ledger.read_text().splitlines() if not json.loads(line)[2])
    (status,) = pool_status(pool_dir)
    assert not status.locked and status.pending == expected
    with Outbox(slot_path.with_name("slot-1.db")) as live:  # another worker, alive, looks for dead slots
        assert [(s.path, s.pending) for s in OutboxPool(pool_dir).adoptable(live.path)] == [(slot_path, expected)]
    # A worker starting now claims the dead slot (the lowest free one) and gets its messages as rows.
    with OutboxPool(pool_dir).claim(durability="process", max_messages=1_000) as claimed:  # type: ignore[arg-type]
        assert claimed.path == slot_path and len(claimed.pending()) == expected


def test_a_torn_last_record_ends_the_journal_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    journal = AcceptJournal(path)
    for seq in range(1, 4):
        journal.append(seq, one(f"v-{seq}".encode()), 1)
    journal.close()
    (segment,) = segment_paths(path)
    data = bytearray(segment.read_bytes())
    # The third record as a SIGKILL mid-copy leaves it: its head written, its body cut short.
    third = data.index(b"v-3")
    data[third:third + 3] = b"\0\0\0"
    segment.write_bytes(bytes(data))
    assert [m.value for _, m, _ in read_journal(path)] == [b"v-1", b"v-2"]


def test_a_full_disk_refuses_the_message_and_keeps_nothing_of_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "outbox.db"

    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with Outbox(path) as box:
        monkeypatch.setattr(os, "posix_fallocate", no_space)
        with pytest.raises(OutboxError, match="No space left on device"):
            box.append(one(b"refused"))
        assert box.stats().pending == 0 and not segment_paths(path)
        monkeypatch.undo()
        seqs = box.append(one(b"accepted"))
        assert [r.seq for r in box.pending()] == seqs


def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    with Outbox(tmp_path / "outbox.db", max_messages=5, max_bytes=100) as box:
        with pytest.raises(SerializationError, match="must be bytes"):
            box.append([NewMessage(new_id(), "orders", "a str")])  # type: ignore[arg-type]
        with pytest.raises(SerializationError, match="must be bytes"):
            box.append(one(b"v", headers=(("h", "str"),)))
        with pytest.raises(OutboxFull, match="can never fit"):
            box.append(one(b"x" * 101))
        assert box.stats().pending == 0 and read_journal(box.path) == []


def test_old_undelivered_messages_settle_into_rows_and_settled_segments_go(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outbox_front, "_SETTLE_AGE_MS", 0)
    monkeypatch.setattr(outbox_front, "_SETTLE_EVERY_S", 0.0)
    path = tmp_path / "outbox.db"
    with Outbox(path) as box:
        assert box._journal is not None
        box._journal._segment_bytes = 4096  # a new segment every ~30 records
        seqs = [box.append(one(f"v-{i}".encode()))[0] for i in range(100)]
        assert len(segment_paths(path)) > 2
        box.mark_delivered(seqs[::2])  # a delivery round: settles the rest (all old enough here)
        assert not box._unsettled
        assert len(segment_paths(path)) == 1  # only the current one is kept
        db = box._conn.execute("SELECT count(*) FROM messages").fetchone()[0]
        assert db == 50
        box.mark_delivered(seqs[1::2])
        assert box.stats().pending == 0
    assert not segment_paths(path)


def test_append_one_writes_what_append_writes_and_refuses_the_same(tmp_path: Path) -> None:
    """send()'s path (append_one) against send_many()'s (append) for one message: the same seqs in order,
    the same records read back across a segment boundary, and bad input refused with nothing written."""
    path = tmp_path / "o.db"
    box = Outbox(path)
    box._journal = AcceptJournal(path, segment_bytes=4096)  # a new segment every few dozen records
    box._record_one = box._journal.append_one  # append_one()'s bound writer, as _open_journal() binds it
    sent = []
    for i in range(200):
        m = one(f"v-{i}".encode(), key=b"k" if i % 3 else None)[0]
        seq = box.append_one(m) if i % 2 else box.append([m])[0]
        sent.append((seq, m))
    assert [s for s, _ in sent] == list(range(sent[0][0], sent[0][0] + 200))
    assert len(segment_paths(path)) > 2
    with pytest.raises(SerializationError):
        box.append_one(NewMessage(new_id(), "orders", "not bytes"))  # type: ignore[arg-type]
    assert [(s, m) for s, m, _ in read_journal(path)] == sent
    assert box.stats().pending == 200
    box.close()


def test_both_record_layouts_read_back_as_written_and_a_layout_an_older_version_cannot_read_is_refused(
    tmp_path: Path,
) -> None:
    """append_one() writes a message without headers or partition in the fixed layout and any other one
    with marshal (journal.py): tombstones, empty values, keys, non-ASCII ids and topics, headers and
    partitions all read back as they were written, in seq order, the two layouts interleaved. A body
    that is neither (a later version's, say) stops the open with OutboxError naming the journal."""
    path = tmp_path / "o.db"
    journal = AcceptJournal(path, segment_bytes=4096)
    messages = [
        NewMessage("id-1", "orders", b"v" * 100),
        NewMessage("id-2", "orders", None, b"k"),  # a tombstone
        NewMessage("id-3", "orders", b"", None),
        NewMessage("id-\u00e9-4", "t\u00f6pic", b"\x00\xff", b""),
        NewMessage("id-5", "orders", b"h", None, (("trace", b"x"),)),  # headers: marshal
        NewMessage("id-6", "orders", b"p", None, (), 2),  # a partition: marshal
        NewMessage("id-7", "orders", bytes(range(256)) * 20, b"key"),
    ]
    for seq, m in enumerate(messages * 3, 1):
        journal.append_one(seq, m, 1_700_000_000_000 + seq)
    journal.close()
    back = read_journal(path)
    assert [(seq, m, ms) for seq, m, ms in back] == [
        (seq, m, 1_700_000_000_000 + seq) for seq, m in enumerate(messages * 3, 1)]
    layouts = set()
    for segment in segment_paths(path):
        data = segment.read_bytes()
        pos = 0
        while int.from_bytes(data[pos:pos + 4], "little"):
            layouts.add(data[pos + 8])
            pos += 8 + int.from_bytes(data[pos:pos + 4], "little")
    assert 1 in layouts and len(layouts) == 2, "both layouts were written"
    with open(segment_paths(path)[-1], "r+b") as f:  # a record of a layout this version does not know
        f.seek(0)
        head = f.read(8)
        body = b"\x7f" + f.read(int.from_bytes(head[:4], "little"))[1:]
        f.seek(0)
        f.write(head[:4] + zlib.crc32(body).to_bytes(4, "little") + body)
    with pytest.raises(OutboxError, match="cannot read"):
        read_journal(path)


def test_journaled_messages_leave_the_garbage_collector_nothing_to_track(tmp_path: Path) -> None:
    """An unsettled message is held as a plain tuple of atoms, which the collector stops tracking: 10,000
    pending messages add (almost) no tracked objects, so send()s do not drive full collections (held as
    (NewMessage, ms) pairs they added 10,006). Read back, they are the messages that were appended."""
    with Outbox(tmp_path / "o.db") as box:
        sent = [one(f"v-{i}".encode(), key=b"k" if i % 2 else None)[0] for i in range(10_000)]
        gc.collect()
        before = len(gc.get_objects())
        seqs = [box.append_one(m) if i % 2 else box.append([m])[0] for i, m in enumerate(sent)]
        gc.collect()
        assert len(gc.get_objects()) - before < 500
        assert box.stats().pending == 10_000
        back = box.pending(limit=None)
        assert [(r.seq, r.message_id, r.key, r.value) for r in back] == [
            (s, m.message_id, m.key, m.value) for s, m in zip(seqs, sent, strict=True)]


def test_fsync_durability_keeps_a_transaction_per_append(tmp_path: Path) -> None:
    """A journal record survives a crash of the process, not a power loss: "fsync" does not use it."""
    with Outbox(tmp_path / "outbox.db", durability="fsync") as box:
        assert not box.journaled
        box.append(one(b"v"))
        assert not segment_paths(box.path)
