"""The outbox's parts through their own seams: the format check, SQLite error mapping, the batch book.

The Outbox's guarantees are proven end to end in test_outbox.py; these pin down each part's contract
so that a change inside one part shows up where it was made.
"""

from __future__ import annotations

import random
import sqlite3
from array import array
from pathlib import Path

import pytest

from reliable_kafka.errors import OutboxCorrupt, OutboxError
from reliable_kafka.ids import new_id
from reliable_kafka.outbox import Outbox, schema
from reliable_kafka.outbox.batches import BatchBook, plain_batch
from reliable_kafka.outbox.sqlite_errors import SQLITE_CORRUPT, SQLITE_FULL, SQLITE_IOERR, SQLITE_READONLY, write_error
from reliable_kafka.spool import NewMessage

pytestmark = pytest.mark.timeout(60)


def _plain(n: int, topic: str = "orders") -> list[NewMessage]:
    return [NewMessage(new_id(), topic, bytes([i]) * (i + 1)) for i in range(n)]


def _error(code: int) -> sqlite3.Error:
    exc = sqlite3.OperationalError("simulated")
    exc.sqlite_errorcode = code  # type: ignore[attr-defined]
    return exc


@pytest.mark.parametrize(
    ("code", "kind", "says"),
    [
        (SQLITE_FULL, OutboxError, "is full"),
        (SQLITE_READONLY, OutboxError, "read-only"),
        (SQLITE_IOERR, OutboxError, "I/O error"),
        (SQLITE_CORRUPT, OutboxCorrupt, "turned out damaged during append"),
        (1, OutboxError, "see the SQLite error above"),
    ],
)
def test_write_errors_name_the_file_and_the_remedy(tmp_path: Path, code: int, kind: type, says: str) -> None:
    path = tmp_path / "x.outbox"
    error = write_error(path, "append", _error(code))
    assert type(error) is kind
    assert says in str(error) and str(path) in str(error)
    if kind is OutboxError:
        assert "nothing was written" in str(error)


def test_plain_batch_only_for_enough_plain_messages_of_one_topic() -> None:
    plain = plain_batch(_plain(8))
    assert plain is not None
    topic, ids, sizes, payload = plain
    assert topic == "orders" and len(ids.split("\n")) == 8
    assert list(sizes) == list(range(1, 9)) and len(payload) == sum(sizes)
    assert plain_batch(_plain(7)) is None  # too few: rows of their own
    assert plain_batch(_plain(7) + _plain(1, topic="other")) is None
    keyed = _plain(8)
    keyed[3] = keyed[3]._replace(key=b"k")
    assert plain_batch(keyed) is None
    assert plain_batch([m._replace(message_id=f"a\n{i}") for i, m in enumerate(_plain(8))]) is None


def test_schema_check_accepts_an_empty_database_and_refuses_a_foreign_one(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    with sqlite3.connect(empty) as conn:
        assert schema.check(empty, conn) is True
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE users (id INTEGER)")
        with pytest.raises(OutboxCorrupt, match="not a reliable-kafka outbox"):
            schema.check(foreign, conn)


def test_batch_book_counts_a_batch_and_frees_it_once_all_its_messages_are_in(tmp_path: Path) -> None:
    path = tmp_path / "book.outbox"
    with Outbox(path) as outbox:
        seqs = outbox.append(_plain(10))
    conn = sqlite3.connect(path)
    try:
        book = BatchBook(keep_sizes=True, follows_writer=False)
        assert book.load(conn) == (10, sum(range(1, 11)))
        assert book.batch_of(seqs[4]) is not None and book.batch_of(seqs[-1] + 1) is None

        rows, in_batches, complete = book.split([*seqs[:3], seqs[-1] + 5])
        assert rows == [seqs[-1] + 5] and in_batches == {seqs[0]: set(seqs[:3])} and complete == []
        assert book.note_done(in_batches, complete) == (3, 1 + 2 + 3)  # the values' sizes are freed
        assert [r.seq for r in book.pending(conn, 0, None)] == seqs[3:]

        rows, in_batches, complete = book.split(seqs)  # repeats of the confirmed three are ignored
        assert rows == [] and in_batches == {seqs[0]: set(seqs[3:])} and complete == [seqs[0]]
        assert book.note_done(in_batches, complete) == (7, sum(range(4, 11)))
        assert book.batches == {} and book.oldest_created_ms() is None
    finally:
        conn.close()


def test_batch_book_split_sorts_every_seq_as_one_lookup_per_seq_would() -> None:
    """split() takes each batch row's run of seqs at once: the same answer as looking each seq up, for
    seqs in any order, repeated, before, between and after batch rows, some already confirmed."""
    rng = random.Random(7)
    for _ in range(300):
        book = BatchBook(keep_sizes=False, follows_writer=False)
        first = rng.randint(1, 5)
        for _batch in range(rng.randint(1, 5)):
            count = rng.randint(1, 6)
            book.inserted(first, count, 0, 0, array("I"))
            book.batches[first].done = {s for s in range(first, first + count) if rng.random() < 0.3}
            first += count + rng.choice([0, 0, 1, 3])  # message rows may lie between batch rows
        seqs = [rng.randint(0, first + 2) for _ in range(rng.randint(0, 25))]

        rows: list[int] = []
        expected: dict[int, set[int]] = {}
        for seq in seqs:
            batch = book.batch_of(seq)
            if batch is None:
                rows.append(seq)
            elif seq not in batch.done:
                expected.setdefault(batch.first, set()).add(seq)
        complete = {f for f, s in expected.items() if len(book.batches[f].done) + len(s) == book.batches[f].count}

        got_rows, got, got_complete = book.split(seqs)
        assert sorted(got_rows) == sorted(rows) and got == expected and set(got_complete) == complete


def test_plain_batch_needs_bytes_values() -> None:
    assert plain_batch([m._replace(value=bytearray(m.value or b"")) for m in _plain(8)]) is None
    assert plain_batch([m._replace(value=None) for m in _plain(8)]) is None
    assert plain_batch([m._replace(headers=(("h", b"v"),)) if i == 5 else m for i, m in enumerate(_plain(8))]) is None
    assert plain_batch([m._replace(partition=0) if i == 7 else m for i, m in enumerate(_plain(8))]) is None
