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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from reliable_kafka.errors import ConfigError, OutboxFull
from reliable_kafka.outbox.batches import BatchBook, plain_batch
from reliable_kafka.outbox.file import OutboxFile, parse_durability
from reliable_kafka.outbox.rows import (
    COLUMNS,
    FAILED,
    INSERT_SQL,
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
    ) -> None:
        self.path = Path(os.fspath(path)).absolute()
        self.durability = parse_durability(durability)
        if max_messages < 1:
            raise ConfigError("max_messages", f"must be at least 1, got {max_messages}")
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError("max_bytes", f"must be at least 1 (or None for no byte bound), got {max_bytes}")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.read_only = read_only
        self._cond = threading.Condition(threading.Lock())
        # Running totals of rows in the spool, so stats() and the bound check never scan the table;
        # _bytes (payload bytes of all rows) is kept up to date only when max_bytes bounds it.
        self._pending = 0
        self._failed = 0
        self._bytes = 0
        self._book = BatchBook(keep_sizes=max_bytes is not None, follows_writer=read_only)
        self._file = OutboxFile(self.path, self.durability, read_only=read_only)
        self._conn = self._file.conn
        try:
            self._load_totals()
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
        if count > self.max_messages or (self.max_bytes is not None and size > self.max_bytes):
            raise OutboxFull(
                f"a batch of {count} messages ({size} bytes) can never fit outbox {self.path} "
                f"(max_messages={self.max_messages}, max_bytes={self.max_bytes}); send smaller batches "
                "or raise the bound"
            )
        deadline = time.monotonic() + timeout
        with self._cond:
            self._file.writable()
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
        # One writer inside one transaction: AUTOINCREMENT hands out consecutive seqs.
        return list(range(last - count + 1, last + 1))

    def mark_delivered(self, seqs: Iterable[int]) -> None:
        """Remove delivered messages in one transaction; unknown seqs (already removed) are ignored."""
        wanted = list(seqs)
        if not wanted:
            return
        pending = failed = freed = 0
        count_bytes = self.max_bytes is not None
        with self._cond:
            self._file.writable()
            # Seqs of batch rows are noted in memory; a batch row goes once all of its messages are in.
            in_batches: dict[int, set[int]] = {}
            complete: list[int] = []
            if self._book.batches:
                wanted, in_batches, complete = self._book.split(wanted)
            if not wanted and not complete:
                if in_batches:
                    self._batches_done(in_batches, complete)
                return
            with self._file.transaction("mark_delivered") as conn:
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
            try:
                raw = self._conn.execute(
                    f"SELECT {COLUMNS} FROM messages WHERE state = 'pending' AND seq > ? ORDER BY seq LIMIT ?",
                    (after_seq, -1 if limit is None else limit),
                ).fetchall()
                from_batches = self._book.pending(self._conn, after_seq, limit)
            except sqlite3.Error as exc:
                raise read_error(self.path, exc) from exc
        rows = [row_of(r) for r in raw]
        if from_batches:
            rows = sorted(rows + from_batches, key=lambda r: r.seq)[:limit]
        return rows

    def get(self, seq: int) -> OutboxRow | None:
        """The row with this seq in any state, or None once it was delivered (or purged)."""
        with self._cond:
            self._file.usable()
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
                self._file.close()
            finally:
                self._cond.notify_all()
        log.info("outbox %s closed", self.path)

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
