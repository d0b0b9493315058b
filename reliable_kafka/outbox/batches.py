"""The `batches` table and what the owning process keeps in memory of it: which messages of each batch
row were confirmed, and the seq ranges to find a seq's batch by bisection.

A batch row goes only when all its messages are confirmed; a batch that needs per-message changes is
exploded into `messages` rows (same seqs) first. Not thread-safe: the Outbox calls it under its lock.
"""

from __future__ import annotations

import bisect
import sqlite3
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reliable_kafka.outbox import schema
from reliable_kafka.outbox.rows import PENDING, chunks, placeholders
from reliable_kafka.spool import NewMessage, OutboxRow

# A batch of fewer plain messages is spooled row by row: one row per batch pays off from a few messages,
# and small batches are the ones a failure or an inspection is most likely to look at one by one.
BATCH_MIN = 8

_SELECT_ONE = "SELECT topic, ids, sizes, payload, created_ms FROM batches WHERE first_seq = ?"


@dataclass(slots=True)
class SpooledBatch:
    """What the owner keeps in memory of one `batches` row."""

    first: int
    count: int
    created_ms: int
    size: int  # payload bytes of its undelivered messages (of all of them when `sizes` is None)
    done: set[int]  # seqs confirmed delivered since this process opened the outbox
    sizes: array[int] | None = None  # each value's length, kept when a byte bound needs it

    @property
    def last(self) -> int:
        return self.first + self.count - 1


def plain_batch(messages: Sequence[NewMessage]) -> tuple[str, str, array[int], bytes] | None:
    """(topic, ids, sizes, payload) of a `batches` row when every message is plain, else None."""
    if len(messages) < BATCH_MIN:
        return None
    # send_many()'s path: the checks run over the batch's columns (zip and count are C loops), not an
    # attribute test per message in Python (~0.1 us a message of 1,000-message batches).
    ids, topics, values, keys, headers, partitions = zip(*messages, strict=True)
    n, topic = len(messages), topics[0]
    if (topics.count(topic) != n or keys.count(None) != n or partitions.count(None) != n or any(headers)
            or set(map(type, values)) != {bytes}):
        return None
    joined = "\n".join(ids)
    if joined.count("\n") != n - 1:  # a caller's own id with a newline in it
        return None
    return topic, joined, array("I", map(len, values)), b"".join(values)


def _sizes_blob(sizes: array[int]) -> bytes:
    if sys.byteorder == "big":
        sizes = array("I", sizes)
        sizes.byteswap()
    return sizes.tobytes()


def _sizes_of(blob: bytes) -> array[int]:
    sizes = array("I")
    sizes.frombytes(blob)
    if sys.byteorder == "big":
        sizes.byteswap()
    return sizes


def _batch_rows(first: int, topic: str, ids: str, sizes_blob: bytes, payload: bytes, created_ms: int,
                skip: set[int], after_seq: int = 0, only: int | None = None) -> list[OutboxRow]:
    """The pending rows of one `batches` row: seqs > after_seq not in `skip` (or just seq `only`)."""
    sizes = _sizes_of(sizes_blob)
    message_ids = ids.split("\n")
    rows = []
    pos = 0
    for i, size in enumerate(sizes):
        seq = first + i
        if seq > after_seq and seq not in skip and (only is None or seq == only):
            rows.append(OutboxRow(seq, message_ids[i], topic, None, payload[pos:pos + size], (), None, PENDING, 0,
                                  None, created_ms))
        pos += size
    return rows


class BatchBook:
    """The in-memory view of the `batches` table, and the SQL on it.

    `keep_sizes`: keep each value's length, so that confirming part of a batch frees its bytes (needed
    only under a byte bound). `follows_writer`: a read-only viewer, whose view is reloaded before each
    read because the owning producer changes the file under it.
    """

    def __init__(self, *, keep_sizes: bool, follows_writer: bool) -> None:
        self.keep_sizes = keep_sizes
        self.follows_writer = follows_writer
        # `batches` rows by first seq, and their first seqs in order (to find a seq's batch by bisection).
        self.batches: dict[int, SpooledBatch] = {}
        self._firsts: list[int] = []
        self.table_exists = True  # False for a version 1 file opened read-only (no batches table)

    def load(self, conn: sqlite3.Connection) -> tuple[int, int]:
        """Rebuild the view from the table (nothing of it counts as delivered yet); (messages, bytes)."""
        self.batches = {}
        self.table_exists = schema.has_batches_table(conn)
        pending = total_bytes = 0
        if self.table_exists:
            for first, count, created_ms, size, sizes in conn.execute(
                    "SELECT first_seq, count, created_ms, length(payload), sizes FROM batches ORDER BY first_seq"):
                kept = _sizes_of(sizes) if self.keep_sizes else None
                self.batches[first] = SpooledBatch(first, count, created_ms, size, set(), kept)
                pending += count
                total_bytes += size
        self._firsts = list(self.batches)
        return pending, total_bytes

    # ------------------------------------------------------------------ appending

    def insert(self, conn: sqlite3.Connection, count: int, plain: tuple[str, str, array[int], bytes],
               now_ms: int) -> int:
        """Write one `batches` row inside the caller's transaction; returns its last seq."""
        # Reserve the batch's seqs from the messages table's AUTOINCREMENT sequence, which never hands
        # out a seq at or below its value.
        found = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
        last: int = (found[0] if found else 0) + count
        conn.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (last - count + 1, count, plain[0], plain[1], _sizes_blob(plain[2]), plain[3], now_ms))
        if found:
            conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'messages'", (last,))
        else:
            conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('messages', ?)", (last,))
        return last

    def inserted(self, first: int, count: int, now_ms: int, size: int, sizes: array[int]) -> None:
        """Note a batch row whose transaction committed."""
        self.batches[first] = SpooledBatch(first, count, now_ms, size, set(), sizes if self.keep_sizes else None)
        self._firsts.append(first)  # seqs only grow: the list stays sorted

    # ------------------------------------------------------------------ confirming

    def batch_of(self, seq: int) -> SpooledBatch | None:
        firsts = self._firsts
        i = bisect.bisect_right(firsts, seq) - 1
        if i < 0:
            return None
        batch = self.batches[firsts[i]]
        return batch if seq <= batch.last else None

    def split(self, seqs: list[int]) -> tuple[list[int], dict[int, set[int]], list[int]]:
        """Sort confirmed seqs: (seqs of `messages` rows, new seqs per batch row, batch rows now complete)."""
        # The poller's path, once per round of delivery reports: the seqs are sorted and each batch row
        # takes its run of them with two bisections and one set difference, all in C. A bisection and a
        # set insertion per seq in Python was ~0.3 us per delivered message of an outbox-only loop
        # (1,000-message batches), most of what recording their delivery cost.
        firsts, batches = self._firsts, self.batches
        if not firsts:
            return list(seqs), {}, []
        ordered = sorted(seqs)
        rows: list[int] = []
        in_batches: dict[int, set[int]] = {}
        complete: list[int] = []
        i, n, k_max = 0, len(ordered), len(firsts) - 1
        while i < n:
            k = bisect.bisect_right(firsts, ordered[i]) - 1
            if k >= 0:
                batch = batches[firsts[k]]
                last = batch.first + batch.count - 1
                if ordered[i] <= last:
                    j = bisect.bisect_right(ordered, last, i)
                    new = set(ordered[i:j])
                    new -= batch.done
                    if new:
                        in_batches[batch.first] = new
                        if len(batch.done) + len(new) == batch.count:
                            complete.append(batch.first)
                    i = j
                    continue
            # In no batch row: every seq up to the next batch row's first is a `messages` row.
            j = bisect.bisect_left(ordered, firsts[k + 1], i) if k < k_max else n
            rows += ordered[i:j]
            i = j
        return rows, in_batches, complete

    @staticmethod
    def delete(conn: sqlite3.Connection, firsts: Sequence[int]) -> None:
        """Delete complete batch rows inside the caller's transaction (then note_done() them)."""
        for chunk in chunks(firsts):
            conn.execute(f"DELETE FROM batches WHERE first_seq IN ({placeholders(len(chunk))})", chunk)

    def note_done(self, in_batches: dict[int, set[int]], complete: list[int]) -> tuple[int, int]:
        """Apply split()'s result once its transaction, if any, committed: (messages confirmed, bytes freed;
        the bytes are counted only with `keep_sizes`)."""
        delivered = freed = 0
        for first, seqs_in in in_batches.items():
            batch = self.batches[first]
            batch.done |= seqs_in
            delivered += len(seqs_in)
            if batch.sizes is not None:
                sizes = batch.sizes
                gone = sum(sizes[seq - first] for seq in seqs_in)
                batch.size -= gone
                freed += gone
        for first in complete:
            freed += self._forget(first).size
        return delivered, freed

    def _forget(self, first: int) -> SpooledBatch:
        batch = self.batches.pop(first)
        del self._firsts[bisect.bisect_left(self._firsts, first)]
        return batch

    # ------------------------------------------------------------------ per-message changes

    def explode(self, conn: sqlite3.Connection, seqs: Iterable[int]) -> list[int]:
        """Give the undelivered messages of the batch rows holding `seqs` rows of their own (same seqs),
        inside the caller's transaction, so per-message changes (failed, attempts, purge) apply to them.
        Returns the batches' first seqs: pass them to exploded() once the transaction committed."""
        firsts = sorted({batch.first for seq in seqs if (batch := self.batch_of(seq)) is not None})
        for first in firsts:
            found = conn.execute(_SELECT_ONE, (first,)).fetchone()
            if found is None:
                continue
            rows = _batch_rows(first, found[0], found[1], found[2], found[3], found[4], self.batches[first].done)
            conn.executemany(
                "INSERT INTO messages (seq, message_id, topic, key, value, headers, partition, created_ms) "
                "VALUES (?, ?, ?, NULL, ?, NULL, NULL, ?)",
                [(r.seq, r.message_id, r.topic, r.value, r.created_ms) for r in rows],
            )
            conn.execute("DELETE FROM batches WHERE first_seq = ?", (first,))
        return firsts

    def exploded(self, firsts: list[int]) -> None:
        """The batch rows are gone and their undelivered messages are rows of their own: counts and
        bytes stay as they are (a batch's delivered messages were subtracted as they came in)."""
        for first in firsts:
            self._forget(first)

    def delete_all(self, conn: sqlite3.Connection) -> tuple[int, int]:
        """Delete every batch row inside the caller's transaction: (undelivered messages, their bytes).
        Call forget_all() once the transaction committed."""
        conn.execute("DELETE FROM batches")
        return (sum(b.count - len(b.done) for b in self.batches.values()),
                sum(b.size for b in self.batches.values()))

    def forget_all(self) -> None:
        self.batches.clear()
        self._firsts.clear()

    # ------------------------------------------------------------------ reading

    def pending(self, conn: sqlite3.Connection, after_seq: int, limit: int | None,
                only: int | None = None) -> list[OutboxRow]:
        """Undelivered messages of batch rows with seq > after_seq (at least `limit` of them, when there
        are), or just seq `only`."""
        if self.follows_writer:
            self.load(conn)
        firsts = self._firsts
        if not firsts:
            return []
        rows: list[OutboxRow] = []
        for first in firsts[max(0, bisect.bisect_right(firsts, after_seq) - 1):]:
            if limit is not None and len(rows) >= limit:
                break
            batch = self.batches[first]
            if batch.last <= after_seq:
                continue
            if only is not None and not batch.first <= only <= batch.last:
                continue
            found = conn.execute(_SELECT_ONE, (first,)).fetchone()
            if found is not None:
                rows.extend(_batch_rows(first, found[0], found[1], found[2], found[3], found[4], batch.done,
                                        after_seq, only))
            if only is not None:
                break
        return rows

    def oldest_created_ms(self) -> int | None:
        """When the oldest batch row still spooled was appended."""
        return self.batches[self._firsts[0]].created_ms if self._firsts else None
