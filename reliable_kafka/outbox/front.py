"""Outbox: the crash-safe SQLite spool behind ReliableProducer; it composes the file, the two tables'
parts and the bound, and is the one lock around them.

A message appended here is durable when append() returns (WAL + synchronous=NORMAL or FULL) and leaves
the spool only through mark_delivered() or an explicit purge(); a file that fails its checks is never touched.

The bound (``max_messages``, ``max_bytes``) counts every row in the spool, pending and failed, because
both take disk: failed rows leave only through purge() or retry_failed() and a later delivery. The
running totals it is checked against live here, so that neither the bound nor stats() scans the table.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from reliable_kafka.errors import ConfigError, OutboxFull, SerializationError
from reliable_kafka.outbox.batches import BATCH_MIN, BatchBook, plain_batch
from reliable_kafka.outbox.file import OutboxFile, parse_durability
from reliable_kafka.outbox.journal import AcceptJournal, read_journal
from reliable_kafka.outbox.rows import (
    COLUMNS,
    FAILED,
    INSERT_SQL,
    INSERT_WITH_SEQ_SQL,
    PENDING,
    STATES,
    chunks,
    count_rows,
    delete_rows,
    placeholders,
    row_of,
    rows_of,
    selection,
)
from reliable_kafka.outbox.sqlite_errors import read_error
from reliable_kafka.spool import Durability, NewMessage, OutboxRow, OutboxStats

log = logging.getLogger("reliable_kafka.outbox")

# Appends of fewer messages than a batch row takes go to the journal (journal.py) instead of a SQLite
# transaction each: a send() is one message. Larger ones are send_many() batches, for which one
# transaction (a batch row, when plain) is cheap per message.
JOURNAL_MAX = BATCH_MIN - 1
# The journal is settled into SQLite at most this often from the delivery path (a transaction each) ...
_SETTLE_EVERY_S = 0.5
# ... moving only what is still undelivered after this long. A message confirmed before its settle never
# costs SQLite a row (nor its deletion), and under load a message waits in librdkafka's queue for up to
# max_in_flight / throughput seconds (20,000 at 20k msgs/s: 1 s): an age below that settled most messages
# into SQLite one row each, and sends from 16 threads ran at 0.29x of raw again. Deliveries are recorded
# in the journal itself (AcceptJournal.delivered), so a crash re-sends no more than with SQLite rows.
_SETTLE_AGE_MS = 5_000
# While nothing is confirmed (brokers away), appends settle everything once this many wait in memory.
_SETTLE_BACKLOG = 100_000
_MARKER_KEY = "journal_settled_seq"


class Outbox:
    """The durable spool of one producer process.

    Thread-safe: one SQLite connection behind one lock; append() may be called from many threads while a
    poller thread calls mark_delivered(). Every write is one transaction (group commit per batch).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Durability | str = "process",
        max_messages: int = 1_000_000,
        max_bytes: int | None = None,
        read_only: bool = False,
        journal: bool | None = None,
    ) -> None:
        """`journal`: take appends of up to JOURNAL_MAX messages through the accept journal (journal.py)
        instead of a transaction each; None (the default) uses it for durability "process" only, since a
        journal record survives a crash of the process but not a power loss."""
        self.path = Path(os.fspath(path)).absolute()
        self.durability = parse_durability(durability)
        if max_messages < 1:
            raise ConfigError("max_messages", f"must be at least 1, got {max_messages}")
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError("max_bytes", f"must be at least 1 (or None for no byte bound), got {max_bytes}")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.read_only = read_only
        # `with self._lock` where nothing waits (append_one): the C-level lock, not Condition.__enter__'s call.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Running totals of rows in the spool, so stats() and the bound check never scan the table;
        # _bytes (payload bytes of all rows) is kept up to date only when max_bytes bounds it.
        self._pending = 0
        self._failed = 0
        self._bytes = 0
        self._book = BatchBook(keep_sizes=max_bytes is not None, follows_writer=read_only)
        if journal is None:
            journal = self.durability is Durability.PROCESS
        self._journal: AcceptJournal | None = None
        # append_one()'s record writer, bound once: the journal's append_one while single appends go to the
        # journal (a writable outbox with a journal and no byte bound, whose size a record does not track).
        self._record_one: Callable[[int, NewMessage, int], None] | None = None
        # Journaled messages not settled into SQLite yet, by seq (in seq order), with when each was accepted:
        # see _Unsettled for why an entry is one plain tuple rather than the NewMessage.
        self._unsettled: dict[int, _Unsettled] = {}
        self._settled_upto = 0  # every journal record with seq <= this is in SQLite or was delivered
        self._next_seq = 0  # with the journal: the next seq to hand out (SQLite's sequence trails it)
        self._last_settle = 0.0
        self._journal_oldest_ms: int | None = None  # a read-only viewer's: the oldest unsettled record
        self._file = OutboxFile(self.path, self.durability, read_only=read_only)
        self._conn = self._file.conn
        try:
            self._load_totals()
            if journal and not read_only:
                self._open_journal()
        except sqlite3.Error as exc:
            self._file.close()
            raise self._file.open_error(exc) from exc
        except BaseException:
            self._file.close()
            raise
        # A read-only open is a look (outbox status, the pool's scan for slots to adopt): not worth an INFO line.
        log.log(
            logging.DEBUG if read_only else logging.INFO,
            "outbox %s opened (%s%s): %d pending, %d failed",
            self.path,
            self.durability.value,
            ", read-only" if read_only else "",
            self._pending,
            self._failed,
        )

    def _load_totals(self) -> None:
        in_batches, batch_bytes = self._book.load(self._conn)
        pending, failed, total_bytes = count_rows(self._conn)
        self._pending, self._failed, self._bytes = pending + in_batches, failed, total_bytes + batch_bytes
        if self.read_only:
            # What the owner (or a run that died) holds in its journal only is pending too: the pool
            # adopts a dead slot by this count, and a message only in the journal must not be stranded.
            marker = self._marker()
            unsettled = [r for r in read_journal(self.path) if r[0] > marker]
            self._pending += len(unsettled)
            self._bytes += sum(_size(m) for _, m, _ in unsettled)
            self._journal_oldest_ms = min((ms for _, _, ms in unsettled), default=None)

    @property
    def journaled(self) -> bool:
        """Appends of a few messages go through the accept journal: no transaction, no lock released."""
        return self._journal is not None

    def _marker(self) -> int:
        found = self._conn.execute("SELECT value FROM meta WHERE key = ?", (_MARKER_KEY,)).fetchone()
        return int(found[0]) if found else 0

    # ------------------------------------------------------------------ the accept journal

    def _open_journal(self) -> None:
        """Settle what a run that did not close left in the journal, then start an empty one."""
        marker = self._marker()
        left = [r for r in read_journal(self.path) if r[0] > marker]
        found = self._conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
        top = max(marker, found[0] if found else 0, left[-1][0] if left else 0)
        if left:
            rows, size = _rows_with_seqs(left)
            with self._file.transaction("settle the journal") as conn:
                conn.executemany(INSERT_WITH_SEQ_SQL, rows)
                _settle_marks(conn, top)
            self._pending += len(left)
            self._bytes += size
            log.info("outbox %s: %d message(s) of a run that did not close taken from its journal",
                     self.path, len(left))
        self._journal = AcceptJournal(self.path)
        self._journal.clear()
        if self.max_bytes is None:
            self._record_one = self._journal.append_one
        self._next_seq = top + 1
        self._settled_upto = top

    def _journal_append(self, messages: Sequence[NewMessage], timeout: float) -> list[int]:
        """append() for a few messages: journal records, no transaction (see journal.py)."""
        journal = self._journal
        assert journal is not None
        count = len(messages)
        for m in messages:  # what rows_of() refuses on the SQLite path, refused the same way here
            key, value = m.key, m.value
            if not ((value is None or type(value) is bytes) and (key is None or type(key) is bytes)) or (
                    m.headers and not all(type(k) is str and type(v) is bytes for k, v in m.headers)):
                raise SerializationError(f"cannot spool message {m.message_id}: key, value and header values "
                                         f"must be bytes (or None), got {type(key).__name__} / "
                                         f"{type(value).__name__}")
        size = 0
        if self.max_bytes is not None:
            size = sum(map(_size, messages))
        self._check_fits(count, size)
        now_ms = time.time_ns() // 1_000_000
        with self._cond:
            self._file.writable()
            if self._over_bound(count, size):
                self._wait_for_room(count, size, timeout)
            first = self._next_seq
            journal.append(first, messages, now_ms)
            unsettled = self._unsettled
            for seq, m in enumerate(messages, first):
                unsettled[seq] = m + (now_ms,)
            self._next_seq = first + count
            self._pending += count
            self._bytes += size
            if len(unsettled) >= _SETTLE_BACKLOG:
                self._settle(force=True)
        return list(range(first, first + count))

    def append_one(self, m: NewMessage, timeout: float = 30.0) -> int:
        """append() of one message; returns its seq. send()'s path: with the journal, a message without
        headers under a count bound only is one record and no list, range or loop (the rest, and every
        refusal, goes through append() as before)."""
        record = self._record_one
        value, key = m[2], m[3]
        if (record is None or m[4]
                or not ((value is None or type(value) is bytes) and (key is None or type(key) is bytes))):
            return self.append((m,), timeout=timeout)[0]
        now_ms = time.time_ns() // 1_000_000
        with self._lock:
            if self._file.closed:
                self._file.writable()  # raises: closed since `record` was read
            if self._pending + self._failed >= self.max_messages:
                self._wait_for_room(1, 0, timeout)
            seq = self._next_seq
            record(seq, m, now_ms)
            unsettled = self._unsettled
            unsettled[seq] = m + (now_ms,)  # a plain tuple: see _Unsettled
            self._next_seq = seq + 1
            self._pending += 1
            if len(unsettled) >= _SETTLE_BACKLOG:
                self._settle(force=True)
        return seq

    def _settle(self, *, force: bool) -> None:
        """(Lock held.) Move journaled messages still undelivered into SQLite and advance the marker, in one
        transaction: all of them (`force`), or those older than _SETTLE_AGE_MS up to the first younger one."""
        if self._journal is None:
            return
        self._last_settle = time.monotonic()
        unsettled = self._unsettled
        cutoff = self._next_seq - 1
        if force:
            move = list(unsettled.items())
        else:
            old_enough = time.time_ns() // 1_000_000 - _SETTLE_AGE_MS
            move = []
            for seq, entry in unsettled.items():
                if entry[_ACCEPTED_MS] > old_enough:
                    cutoff = seq - 1
                    break
                move.append((seq, entry))
        if cutoff <= self._settled_upto:
            return
        rows, _ = _rows_with_seqs([(seq, _message(e), e[_ACCEPTED_MS]) for seq, e in move])
        with self._file.transaction("settle the journal") as conn:
            if rows:
                conn.executemany(INSERT_WITH_SEQ_SQL, rows)
            _settle_marks(conn, cutoff)
        for seq, _ in move:
            del unsettled[seq]
        self._settled_upto = cutoff
        self._journal.settled(cutoff)

    def _settle_all(self) -> None:
        """(Lock held.) Everything journaled into SQLite: before any operation that reads or changes rows."""
        if self._unsettled or self._settled_upto < self._next_seq - 1:
            self._settle(force=True)

    # ------------------------------------------------------------------ writing

    def _over_bound(self, count: int, size: int) -> bool:
        rows = self._pending + self._failed
        if rows + count > self.max_messages:
            return True
        return self.max_bytes is not None and self._bytes + size > self.max_bytes

    def _forget(self, pending: int, failed: int, freed: int) -> None:
        """Apply deleted rows to the running totals and wake appenders waiting for room."""
        if pending or failed:
            self._pending -= pending
            self._failed -= failed
            self._bytes -= freed
            self._cond.notify_all()

    def append(self, messages: Sequence[NewMessage], *, timeout: float = 30.0) -> list[int]:
        """Spool `messages` in one transaction and return their seqs (strictly increasing).

        Blocks up to `timeout` seconds while the spool is at its bound, then raises OutboxFull; on disk
        errors raises OutboxError and nothing of the batch is stored.
        """
        if not messages:
            return []
        if self._journal is not None and len(messages) <= JOURNAL_MAX:
            return self._journal_append(messages, timeout)
        now_ms = time.time_ns() // 1_000_000
        rows: list[tuple[Any, ...]] = []
        size = 0
        book = self._book
        plain = plain_batch(messages) if book.table_exists else None
        if plain is not None:
            size = len(plain[3])
        else:
            rows, size = rows_of(messages, now_ms)
        count = len(messages)
        self._check_fits(count, size)
        with self._cond:
            self._file.writable()
            if self._over_bound(count, size):
                self._wait_for_room(count, size, timeout)
            # Journaled messages first: SQLite's sequence hands out the seqs after theirs.
            self._settle_all()
            with self._file.transaction("append") as conn:
                if plain is None and count == 1:
                    # One send(): the insert's own lastrowid (execute() sets it, executemany() does not)
                    # saves a statement of the four a per-call commit ran (~5 of its ~35 us CPU).
                    inserted = conn.execute(INSERT_SQL, rows[0]).lastrowid
                    assert inserted is not None  # a successful INSERT sets it
                    last = inserted
                elif plain is None:
                    conn.executemany(INSERT_SQL, rows)
                    last = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
                else:
                    last = book.insert(conn, count, plain, now_ms)
            if plain is not None:
                book.inserted(last - count + 1, count, now_ms, size, plain[2])
            self._pending += count
            if self.max_bytes is not None:
                self._bytes += size
            if self._journal is not None:
                # The journal's next seq follows, and nothing journaled lies at or below `last`.
                self._next_seq, self._settled_upto = last + 1, last
        # One writer inside one transaction: AUTOINCREMENT hands out consecutive seqs.
        return list(range(last - count + 1, last + 1))

    def _check_fits(self, count: int, size: int) -> None:
        """OutboxFull at once for a batch larger than the bound itself: waiting for room would never end."""
        if count > self.max_messages or (self.max_bytes is not None and size > self.max_bytes):
            raise OutboxFull(
                f"a batch of {count} messages ({size} bytes) can never fit outbox {self.path} "
                f"(max_messages={self.max_messages}, max_bytes={self.max_bytes}); send smaller batches "
                "or raise the bound"
            )

    def _wait_for_room(self, count: int, size: int, timeout: float) -> None:
        """(Lock held.) Wait while the spool is at its bound; OutboxFull after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self._over_bound(count, size):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise OutboxFull(
                    f"outbox {self.path} stayed full for {timeout:g}s ({self._pending} pending, "
                    f"{self._failed} failed, {self._bytes} bytes; max_messages={self.max_messages}, "
                    f"max_bytes={self.max_bytes}); the {count} message(s) were not accepted. Kafka is "
                    "not taking messages as fast as they come: check the cluster and "
                    f"`reliable-kafka outbox status --path {self.path}`, or raise the bound"
                )
            self._cond.wait(remaining)
            self._file.usable()

    def mark_delivered(self, seqs: Iterable[int]) -> None:
        """Remove delivered messages in one transaction; unknown seqs (already removed) are ignored."""
        wanted = list(seqs)
        if not wanted:
            return
        pending = failed = freed = 0
        count_bytes = self.max_bytes is not None
        with self._cond:
            self._file.writable()
            if self._journal is not None:
                if self._unsettled:
                    wanted = self._journal_delivered(wanted)
                if time.monotonic() - self._last_settle >= _SETTLE_EVERY_S:
                    self._settle(force=False)
                if not wanted:
                    return
            # Seqs of batch rows are noted in memory; a batch row goes once all of its messages are in.
            in_batches: dict[int, set[int]] = {}
            complete: list[int] = []
            if self._book.batches:
                wanted, in_batches, complete = self._book.split(wanted)
            if not wanted and not complete:
                if in_batches:
                    self._batches_done(in_batches, complete)
                return
            with self._file.transaction("mark_delivered", lazy=True) as conn:
                if complete:
                    self._book.delete(conn, complete)
                for chunk in chunks(wanted):
                    in_chunk = f"seq IN ({placeholders(len(chunk))})"
                    count, size = delete_rows(conn, f"state = 'pending' AND {in_chunk}", chunk,
                                              count_bytes=count_bytes)
                    pending += count
                    freed += size
                    if count < len(chunk):
                        # Rare: a delivery report that came after mark_failed (the message is in Kafka
                        # after all), a repeated seq, or a seq already removed.
                        count, size = delete_rows(conn, in_chunk, chunk, count_bytes=count_bytes)
                        failed += count
                        freed += size
            if in_batches:
                self._batches_done(in_batches, complete)
            self._forget(pending, failed, freed)

    def _journal_delivered(self, seqs: list[int]) -> list[int]:
        """(Lock held.) Forget delivered messages that were never settled (no SQLite write at all);
        returns the seqs that are not among them."""
        pop = self._unsettled.pop
        entries = [pop(seq, None) for seq in seqs]
        if None not in entries:  # the common case, every one journaled and not settled: no second pass
            gone, rest = seqs, []
        else:
            gone = [seq for seq, entry in zip(seqs, entries, strict=True) if entry is not None]
            rest = [seq for seq, entry in zip(seqs, entries, strict=True) if entry is None]
        freed = sum(_size(e) for e in entries if e is not None) if self.max_bytes is not None else 0
        if gone:
            assert self._journal is not None
            self._journal.delivered(gone)
            self._forget(len(gone), 0, freed)
        return rest

    def _batches_done(self, in_batches: dict[int, set[int]], complete: list[int]) -> None:
        """Apply delivered seqs of batch rows (after their transaction, if any, committed)."""
        delivered, freed = self._book.note_done(in_batches, complete)
        if delivered:
            self._pending -= delivered
            if self.max_bytes is not None:
                self._bytes -= freed
            self._cond.notify_all()

    def mark_failed(self, seq: int, reason: str) -> None:
        """Park a message Kafka refused for good: state=failed, last_error=reason, attempts+1."""
        with self._cond:
            self._file.writable()
            self._settle_all()
            with self._file.transaction("mark_failed") as conn:
                exploded = self._book.explode(conn, (seq,))
                found = conn.execute("SELECT state FROM messages WHERE seq = ?", (seq,)).fetchone()
                if found is not None:
                    conn.execute(
                        "UPDATE messages SET state = 'failed', last_error = ?, attempts = attempts + 1 "
                        "WHERE seq = ?",
                        (reason, seq),
                    )
            self._book.exploded(exploded)
            if found is None:
                log.warning(
                    "outbox %s: mark_failed(%d) for a seq not in the spool (%s)", self.path, seq, reason
                )
            elif found[0] == PENDING:
                self._pending -= 1
                self._failed += 1

    def record_attempt(self, seqs: Iterable[int], error: str) -> None:
        """Count a failed send attempt (attempts+1, last_error); the messages keep their state."""
        params = [(error, seq) for seq in seqs]
        if not params:
            return
        with self._cond:
            self._file.writable()
            self._settle_all()
            with self._file.transaction("record_attempt") as conn:
                exploded = self._book.explode(conn, (seq for _, seq in params))
                conn.executemany(
                    "UPDATE messages SET attempts = attempts + 1, last_error = ? WHERE seq = ?", params
                )
            self._book.exploded(exploded)

    def retry_failed(self, seqs: Iterable[int] | None = None) -> int:
        """Move failed messages (all, or those in `seqs`) back to pending, keeping their seq; count them."""
        with self._cond:
            self._file.writable()
            self._settle_all()
            moved = 0
            with self._file.transaction("retry_failed") as conn:
                for where, params in selection(FAILED, seqs):
                    moved += conn.execute(
                        f"UPDATE messages SET state = 'pending' WHERE {where}", params
                    ).rowcount
            self._failed -= moved
            self._pending += moved
        if moved:
            log.info("outbox %s: %d failed message(s) back to pending", self.path, moved)
        return moved

    def purge(self, *, state: str = FAILED, seqs: Iterable[int] | None = None) -> int:
        """Delete messages in `state` (all, or those in `seqs`) for good; returns how many. Explicit only."""
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        purged = freed = 0
        with self._cond:
            self._file.writable()
            self._settle_all()
            wanted = None if seqs is None else list(seqs)
            with self._file.transaction("purge") as conn:
                exploded: list[int] = []
                if state == PENDING:
                    if wanted is None:  # every pending message: the batch rows go whole
                        purged, freed = self._book.delete_all(conn)
                    else:
                        exploded = self._book.explode(conn, wanted)
                for where, params in selection(state, wanted):
                    count, size = delete_rows(conn, where, params, count_bytes=self.max_bytes is not None)
                    purged += count
                    freed += size
            if state == PENDING and wanted is None:
                self._book.forget_all()
            self._book.exploded(exploded)
            if state == PENDING:
                self._forget(purged, 0, freed)
            else:
                self._forget(0, purged, freed)
        if purged:
            log.warning("outbox %s: purged %d %s message(s) on request", self.path, purged, state)
        return purged

    # ------------------------------------------------------------------ reading

    def pending(self, *, after_seq: int = 0, limit: int | None = None) -> list[OutboxRow]:
        """Pending messages with seq > `after_seq`, in seq order (the order they were appended)."""
        with self._cond:
            self._file.usable()
            # Journaled messages come from memory, after every row: all their seqs are above the rows'.
            # (Settling them here instead made each page of the dispatcher's backlog a transaction.)
            journaled = self._unsettled_after(after_seq, limit)
            if journaled and after_seq >= self._settled_upto:
                return journaled  # no row can follow after_seq
            try:
                raw = self._conn.execute(
                    f"SELECT {COLUMNS} FROM messages WHERE state = 'pending' AND seq > ? ORDER BY seq LIMIT ?",
                    (after_seq, -1 if limit is None else limit),
                ).fetchall()
                from_batches = self._book.pending(self._conn, after_seq, limit)
            except sqlite3.Error as exc:
                raise read_error(self.path, exc) from exc
        rows = [row_of(r) for r in raw]
        if self.read_only:
            # A viewer sees what the owner holds in its journal only, as it sees its rows.
            marker = self._marker()
            from_batches += [_journal_row(seq, m, created_ms)
                             for seq, m, created_ms in read_journal(self.path) if seq > max(marker, after_seq)]
        if from_batches:
            rows = sorted(rows + from_batches, key=lambda r: r.seq)[:limit]
        return (rows + journaled)[:limit] if journaled else rows

    def _unsettled_after(self, after_seq: int, limit: int | None) -> list[OutboxRow]:
        """(Lock held.) Journaled messages not settled yet with seq > after_seq, in seq order (at most
        `limit` of them): looked up by seq from after_seq on, not by a walk from the oldest."""
        unsettled = self._unsettled
        if not unsettled:
            return []
        if after_seq < next(iter(unsettled)):
            seqs: Iterable[int] = unsettled
        else:
            seqs = (seq for seq in range(after_seq + 1, self._next_seq) if seq in unsettled)
        out = []
        for seq in seqs:
            out.append(_journaled_row(seq, unsettled[seq]))
            if limit is not None and len(out) >= limit:
                break
        return out

    def get(self, seq: int) -> OutboxRow | None:
        """The row with this seq in any state, or None once it was delivered (or purged)."""
        with self._cond:
            self._file.usable()
            entry = self._unsettled.get(seq)
            if entry is not None:
                return _journaled_row(seq, entry)
            try:
                raw = self._conn.execute(f"SELECT {COLUMNS} FROM messages WHERE seq = ?", (seq,)).fetchone()
                if raw is not None:
                    return row_of(raw)
                found = self._book.pending(self._conn, seq - 1, None, only=seq)
            except sqlite3.Error as exc:
                raise read_error(self.path, exc) from exc
        return found[0] if found else None

    def iter_pending(self, batch: int = 10_000) -> Iterator[OutboxRow]:
        """All pending messages in seq order, read `batch` rows at a time (the lock is free in between)."""
        after = 0
        while True:
            page = self.pending(after_seq=after, limit=batch)
            yield from page
            if len(page) < batch:
                return
            after = page[-1].seq

    def failed(self, limit: int | None = None) -> list[OutboxRow]:
        """Messages Kafka refused for good, in seq order, with their reason in `last_error`."""
        with self._cond:
            self._file.usable()
            self._settle_all()
            try:
                raw = self._conn.execute(
                    f"SELECT {COLUMNS} FROM messages WHERE state = 'failed' ORDER BY seq LIMIT ?",
                    (-1 if limit is None else limit,),
                ).fetchall()
            except sqlite3.Error as exc:
                raise read_error(self.path, exc) from exc
        return [row_of(r) for r in raw]

    def stats(self) -> OutboxStats:
        """Cheap counts: in-memory totals for the owner, a fresh count for a read-only viewer."""
        with self._cond:
            self._file.usable()
            try:
                if self.read_only:  # the owning producer changes the file under us
                    self._load_totals()
                oldest = self._conn.execute(
                    "SELECT created_ms FROM messages WHERE state = 'pending' ORDER BY seq LIMIT 1"
                ).fetchone()
            except sqlite3.Error as exc:
                raise read_error(self.path, exc) from exc
            pending, failed = self._pending, self._failed
            created = [oldest[0]] if oldest is not None else []
            oldest_batch = self._book.oldest_created_ms()
            if oldest_batch is not None:
                created.append(oldest_batch)
            if self._unsettled:
                created.append(next(iter(self._unsettled.values()))[_ACCEPTED_MS])
            if self._journal_oldest_ms is not None:
                created.append(self._journal_oldest_ms)
        age = None if not created else max(0.0, (time.time_ns() // 1_000_000 - min(created)) / 1000)
        return OutboxStats(
            pending=pending,
            failed=failed,
            oldest_pending_age_s=age,
            file_bytes=self._file.bytes_on_disk(),
            max_messages=self.max_messages,
        )

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the database (checkpointing the WAL), release the lock; appenders waiting for room fail."""
        with self._cond:
            if self._file.closed:
                return
            try:
                if self._journal is not None:
                    # A clean close leaves no journal: what is undelivered is in SQLite, like every row.
                    self._settle_all()
                    self._journal.clear()
                    self._journal = None
                    self._record_one = None
                self._file.close()
            finally:
                self._cond.notify_all()
        log.info("outbox %s closed", self.path)

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# An unsettled journal entry: the message's fields in NewMessage's order, then when it was accepted, in one
# plain tuple (`message + (accepted_ms,)`). Plain, because the garbage collector stops tracking a plain tuple
# of atoms (str, bytes, None, a tuple of header pairs) at its first collection, but tracks a NamedTuple for
# as long as it lives: with (NewMessage, ms) entries every unsettled message was two tracked objects, each
# send() a step towards a full collection. (A pair around a plain tuple is not enough either: the collector
# reaches the inner one through the pair and examines the pair first, so the pair outlives a collection.)
_Unsettled = tuple[Any, ...]
_ACCEPTED_MS = len(NewMessage._fields)


def _message(entry: _Unsettled) -> NewMessage:
    return NewMessage._make(entry[:_ACCEPTED_MS])


def _journaled_row(seq: int, entry: _Unsettled) -> OutboxRow:
    return _journal_row(seq, _message(entry), entry[_ACCEPTED_MS])


def _size(m: NewMessage | _Unsettled) -> int:
    """A message's payload bytes as the bound counts them (rows.SIZE_SQL counts the encoded headers;
    this counts their values: close enough for a bound, and free of encoding). By position, so that an
    unsettled entry (NewMessage's fields first) is measured as it is, without a NewMessage made for it."""
    value, key, headers = m[2], m[3], m[4]
    return (len(key) if key else 0) + (len(value) if value else 0) + sum(len(v) for _, v in headers)


def _journal_row(seq: int, m: NewMessage, created_ms: int) -> OutboxRow:
    """A journaled message as a pending row (never attempted: a retry or failure settles it first)."""
    return OutboxRow(seq, m.message_id, m.topic, m.key, m.value, m.headers, m.partition, PENDING, 0, None, created_ms)


def _rows_with_seqs(records: Sequence[tuple[int, NewMessage, int]]) -> tuple[list[tuple[Any, ...]], int]:
    """INSERT_WITH_SEQ_SQL's parameters for journal records, and their payload bytes."""
    rows: list[tuple[Any, ...]] = []
    size = 0
    for seq, m, created_ms in records:
        (row,), bytes_ = rows_of((m,), created_ms)
        rows.append((seq, *row))
        size += bytes_
    return rows, size


def _settle_marks(conn: Any, upto: int) -> None:
    """Inside a settle's transaction: the journal's marker, and SQLite's sequence moved past every seq
    the journal handed out (AUTOINCREMENT must never hand one out again)."""
    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (_MARKER_KEY, str(upto)))
    if conn.execute("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'messages'", (upto,)).rowcount == 0:
        conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('messages', ?)", (upto,))
