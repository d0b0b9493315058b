"""The crash-safe SQLite spool behind ReliableProducer: append, mark delivered, mark failed, replay.

A message appended here is durable when append() returns (WAL + synchronous=NORMAL or FULL) and leaves
the spool only through mark_delivered() or an explicit purge(); a file that fails its checks is never touched.

On-disk layout (schema version 2; a version 1 file is upgraded in place when a producer opens it, by
adding the ``batches`` table):

- ``messages``: ``seq INTEGER PRIMARY KEY AUTOINCREMENT`` (strictly increasing, never reused, also after
  deletes and reopen), ``message_id TEXT`` (the rk-id; a re-sent message keeps its id, so it is not
  unique), ``topic``, ``key BLOB``, ``value BLOB``, ``headers BLOB``, ``partition`` (NULL = let the
  partitioner decide), ``state`` ('pending' | 'failed'), ``attempts``, ``last_error``, ``created_ms``
  (unix ms). No secondary index: "pending in seq order" is a rowid range scan (failed rows are few), and
  every index would cost each append and each delete (measured: without the two we had, appends are
  about 3x and deletes about 3x faster).
- ``batches``: a batch of plain messages (one topic; no key, headers or partition) appended together is
  one row, because on a slow disk or CPU SQLite costs about 10 us per row and the batch's messages
  share everything but their id and value: ``first_seq INTEGER PRIMARY KEY`` (its messages have seqs
  ``first_seq .. first_seq + count - 1``, reserved from the ``messages`` table's AUTOINCREMENT
  sequence, so seqs stay unique and ordered across both tables), ``count``, ``topic``, ``ids`` (the
  message ids joined by newlines), ``sizes`` (the values' lengths, little-endian uint32 each),
  ``payload`` (the values concatenated), ``created_ms``. The row is deleted once every message in it is
  confirmed; which of them were confirmed before that is kept in memory only, so after a crash the
  whole batch is sent again (each copy with its original's rk-id). A message of a batch that fails or
  is retried gets a row of its own in ``messages`` (same seq), and the batch row goes.
- ``meta``: ``key``/``value`` pairs; ``format = reliable-kafka-outbox`` marks the file as ours and
  ``schema_version`` says how to read it.
- ``headers`` encoding: NULL for no headers, otherwise for each (name, value) pair in order a big-endian
  ``uint16`` name length, ``uint32`` value length, the UTF-8 name bytes, then the value bytes.

The bound (``max_messages``, ``max_bytes``) counts every row in the spool, pending and failed, because
both take disk: failed rows leave only through purge() or retry_failed() and a later delivery.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import os
import sqlite3
import struct
import sys
import threading
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reliable_kafka.errors import (
    ConfigError,
    OutboxCorrupt,
    OutboxError,
    OutboxFull,
    OutboxLocked,
    SerializationError,
)
from reliable_kafka.spool import Durability, NewMessage, OutboxRow, OutboxStats

if TYPE_CHECKING:
    import sqlite_utils

log = logging.getLogger(__name__)

FORMAT_MARKER = "reliable-kafka-outbox"
SCHEMA_VERSION = 2
_READABLE_VERSIONS = ("1", "2")  # 1: no batches table; upgraded to 2 when a producer opens it

PENDING = "pending"
FAILED = "failed"
_STATES = (PENDING, FAILED)

# SQLite limits bound parameters per statement (999 before 3.32); IN-lists are chunked below that.
_IN_CHUNK = 900

# Payload size of a row as SQLite sees it; must agree with _payload_size() below.
_SIZE_SQL = "coalesce(length(key), 0) + coalesce(length(value), 0) + coalesce(length(headers), 0)"
_COLUMNS = "seq, message_id, topic, key, value, headers, partition, state, attempts, last_error, created_ms"
_INSERT_SQL = (
    "INSERT INTO messages (message_id, topic, key, value, headers, partition, created_ms) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)
# Raw DDL because sqlite-utils' Table.create exposes neither AUTOINCREMENT (without it SQLite may
# hand a deleted seq out again) nor partial indexes.
_MESSAGES_DDL = """
CREATE TABLE messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id TEXT NOT NULL,
    topic TEXT NOT NULL,
    key BLOB,
    value BLOB,
    headers BLOB,
    partition INTEGER,
    state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'failed')),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    created_ms INTEGER NOT NULL
)"""

_BATCHES_DDL = """
CREATE TABLE batches (
    first_seq INTEGER PRIMARY KEY,
    count INTEGER NOT NULL,
    topic TEXT NOT NULL,
    ids TEXT NOT NULL,
    sizes BLOB NOT NULL,
    payload BLOB NOT NULL,
    created_ms INTEGER NOT NULL
)"""
# A batch of fewer plain messages is spooled row by row: one row per batch pays off from a few messages,
# and small batches are the ones a failure or an inspection is most likely to look at one by one.
_BATCH_MIN = 8

_HEADER = struct.Struct(">HI")
_SQLITE_MAGIC = b"SQLite format 3\x00"

# Primary SQLite result codes we explain to the user (the extended code's low byte is the primary one).
_SQLITE_READONLY = 8
_SQLITE_IOERR = 10
_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_CANTOPEN = 14
_SQLITE_NOTADB = 26


_SYNCHRONOUS = {Durability.PROCESS: "NORMAL", Durability.FSYNC: "FULL"}


def encode_headers(headers: Sequence[tuple[str, bytes]]) -> bytes | None:
    """The compact blob stored in `messages.headers` (see the module docstring); None for no headers."""
    if not headers:
        return None
    parts: list[bytes] = []
    for name, value in headers:
        if type(name) is not str or type(value) is not bytes:
            got = f"({type(name).__name__}, {type(value).__name__})"
            raise TypeError(f"a header must be a (str, bytes) pair, got {got}")
        raw_name = name.encode()
        parts.append(_HEADER.pack(len(raw_name), len(value)))
        parts.append(raw_name)
        parts.append(value)
    return b"".join(parts)


def decode_headers(blob: bytes | None) -> tuple[tuple[str, bytes], ...]:
    """The inverse of encode_headers()."""
    if not blob:
        return ()
    headers: list[tuple[str, bytes]] = []
    pos = 0
    while pos < len(blob):
        name_len, value_len = _HEADER.unpack_from(blob, pos)
        pos += _HEADER.size
        name = blob[pos : pos + name_len].decode()
        pos += name_len
        headers.append((name, blob[pos : pos + value_len]))
        pos += value_len
    return tuple(headers)


def _payload_size(key: bytes | None, value: bytes | None, headers: bytes | None) -> int:
    return (
        (len(key) if key is not None else 0)
        + (len(value) if value is not None else 0)
        + (len(headers) if headers is not None else 0)
    )


@dataclass(slots=True)
class _SpooledBatch:
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


def _plain_batch(messages: Sequence[NewMessage]) -> tuple[str, str, array[int], bytes] | None:
    """(topic, ids, sizes, payload) of a `batches` row when every message is plain, else None."""
    if len(messages) < _BATCH_MIN:
        return None
    topic = messages[0].topic
    values = []
    for m in messages:
        if m.topic != topic or m.key is not None or m.headers or m.partition is not None or type(m.value) is not bytes:
            return None
        values.append(m.value)
    ids = "\n".join([m.message_id for m in messages])
    if ids.count("\n") != len(messages) - 1:  # a caller's own id with a newline in it
        return None
    return topic, ids, array("I", map(len, values)), b"".join(values)


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


def _primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return int(code) & 0xFF
    text = str(exc).lower()  # Python 3.10: classify by SQLite's fixed message texts
    for needle, primary in (
        ("disk is full", _SQLITE_FULL),
        ("readonly", _SQLITE_READONLY),
        ("disk i/o error", _SQLITE_IOERR),
        ("malformed", _SQLITE_CORRUPT),
        ("not a database", _SQLITE_NOTADB),
        ("unable to open", _SQLITE_CANTOPEN),
    ):
        if needle in text:
            return primary
    return None


def _chunks(values: Sequence[Any], size: int = _IN_CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def _placeholders(n: int) -> str:
    return ",".join("?" * n)


def _database(conn: sqlite3.Connection) -> sqlite_utils.Database:
    # Imported on first use: sqlite-utils pulls in pandas when it is installed (~0.6 s, tens of MB),
    # a cost that producers in "memory" mode, which never open an outbox, should not pay.
    import sqlite_utils

    return sqlite_utils.Database(conn, execute_plugins=False)


class _OutboxLock:
    """An exclusive flock on `<outbox>.lock` for the Outbox's lifetime; the file holds the owner's pid.

    The lock file is never deleted: unlinking it would let a third opener lock a fresh inode while a
    second one still waits on the old one, and two processes would both believe they own the outbox.
    """

    def __init__(self, db_path: Path) -> None:
        self.path = db_path.with_name(db_path.name + ".lock")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutboxError(
                f"cannot create the lock file {self.path} for outbox {db_path}: {exc.strerror}; "
                "the outbox directory must be writable by this process"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutboxLocked(
                f"outbox {db_path} is owned by another producer (pid {holder}, lock file {self.path}); "
                "one outbox file serves one process: give each producer its own outbox path, or stop "
                "the other one (read-only tools such as `reliable-kafka outbox status` work meanwhile)"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise OutboxError(f"cannot lock {self.path} for outbox {db_path}: {exc.strerror}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


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
        self.durability = self._parse_durability(durability)
        if max_messages < 1:
            raise ConfigError("max_messages", f"must be at least 1, got {max_messages}")
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError("max_bytes", f"must be at least 1 (or None for no byte bound), got {max_bytes}")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.read_only = read_only
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._lock: _OutboxLock | None = None
        # Running totals of rows in the spool, so stats() and the bound check never scan the table;
        # _bytes (payload bytes of all rows) is kept up to date only when max_bytes bounds it.
        self._pending = 0
        self._failed = 0
        self._bytes = 0
        # `batches` rows by first seq, and their first seqs in order (to find a seq's batch by bisection).
        self._batches: dict[int, _SpooledBatch] = {}
        self._batch_firsts: list[int] = []
        self._has_batches = True  # False for a version 1 file opened read-only (no batches table)
        if read_only:
            self._db = self._open_read_only()
        else:
            self._lock = _OutboxLock(self.path)
            try:
                self._db = self._open_writable()
            except BaseException:
                self._lock.release()
                raise
        self._conn = self._db.conn
        log.info(
            "outbox %s opened (%s%s): %d pending, %d failed",
            self.path,
            self.durability.value,
            ", read-only" if read_only else "",
            self._pending,
            self._failed,
        )

    # ------------------------------------------------------------------ opening

    @staticmethod
    def _parse_durability(durability: Durability | str) -> Durability:
        try:
            parsed = Durability(durability)
        except ValueError:
            raise ConfigError(
                "durability", f"{durability!r} is not one of {[d.value for d in Durability]}"
            ) from None
        if parsed is Durability.MEMORY:
            raise ConfigError(
                "durability",
                "'memory' means no spool; the producer handles it without an Outbox "
                "(use 'process' or 'fsync' to spool to disk)",
            )
        return parsed

    def _open_read_only(self) -> sqlite_utils.Database:
        if not self.path.exists():
            raise OutboxError(f"no such outbox: {self.path} does not exist (check the --path)")
        if self._probe():
            raise OutboxCorrupt(
                f"{self.path} is an empty SQLite file without outbox tables: a producer may be "
                "creating it right now; retry in a moment"
            )
        conn = self._connect(read_only=True)
        try:
            self._load_totals(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise OutboxError(f"cannot read outbox {self.path}: {exc}") from exc
        return _database(conn)

    def _open_writable(self) -> sqlite_utils.Database:
        fresh = True
        if self.path.exists() and self.path.stat().st_size > 0:
            fresh = self._probe()
        elif not self.path.parent.is_dir():
            raise OutboxError(
                f"cannot create outbox {self.path}: directory {self.path.parent} does not exist"
            )
        conn = self._connect(read_only=False)
        try:
            db = _database(conn)
            db.enable_wal()
            # journal_mode=wal is refused silently on a read-only file or filesystem; say so now
            # rather than on the first send.
            if db.journal_mode != "wal" or (self.path.exists() and not os.access(self.path, os.W_OK)):
                raise OutboxError(
                    f"outbox {self.path} is not writable (read-only file or filesystem); fix its "
                    "permissions or choose a writable path"
                )
            conn.execute(f"PRAGMA synchronous={_SYNCHRONOUS[self.durability]}")
            if fresh:
                self._create_schema(db)
            else:
                self._upgrade(conn)
            self._load_totals(conn)
        except sqlite3.Error as exc:
            conn.close()
            raise self._write_error("open", exc) from exc
        except BaseException:
            conn.close()
            raise
        return db

    def _probe(self) -> bool:
        """Check the existing file without changing it; True when it is an empty SQLite database.

        Closing a read-write connection can checkpoint a WAL into the file, and even a read-only one
        creates -wal/-shm files for a WAL-mode header; so when no WAL is left over the check reads the
        file as immutable, which touches nothing at all.
        """
        has_wal = Path(f"{self.path}-wal").exists()
        probe = self._connect(read_only=True, immutable=not has_wal)
        try:
            return self._check(probe)
        finally:
            probe.close()

    def _connect(self, *, read_only: bool, immutable: bool = False) -> sqlite3.Connection:
        target = f"{self.path.as_uri()}?mode={'ro' if read_only else 'rwc'}"
        if immutable:
            target += "&immutable=1"
        try:
            # isolation_level=None: we issue BEGIN IMMEDIATE/COMMIT ourselves, one transaction per call.
            return sqlite3.connect(target, uri=True, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as exc:
            raise OutboxError(f"cannot open outbox {self.path}: {exc}") from exc

    def _corrupt(self, why: str) -> OutboxCorrupt:
        return OutboxCorrupt(
            f"{self.path} {why}; the file was left exactly as it is. Move it aside (keep it: it may hold "
            "undelivered messages) and start again with a fresh outbox path, or point at the right file"
        )

    def _check(self, conn: sqlite3.Connection) -> bool:
        """Refuse anything that is not a healthy outbox; True when the file is an empty SQLite database."""
        with open(self.path, "rb") as fh:
            head = fh.read(len(_SQLITE_MAGIC))
        if head and head != _SQLITE_MAGIC:
            raise self._corrupt("is not a SQLite database")
        try:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise self._corrupt(f"failed SQLite's integrity check ({'; '.join(problems[:3])})")
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                return True
            if not {"messages", "meta"} <= tables:
                raise self._corrupt(
                    f"is a SQLite database but not a reliable-kafka outbox (tables: {sorted(tables)})"
                )
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as exc:
            if _primary_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
                raise self._corrupt(f"is damaged ({exc})") from exc
            raise OutboxError(f"cannot read outbox {self.path}: {exc}") from exc
        if meta.get("format") != FORMAT_MARKER:
            raise self._corrupt(
                "has outbox-like tables but no reliable-kafka outbox marker in its meta table"
            )
        version = meta.get("schema_version")
        if version not in _READABLE_VERSIONS:
            raise OutboxError(
                f"outbox {self.path} has schema version {version}, this reliable-kafka reads version "
                f"{SCHEMA_VERSION}; use the reliable-kafka version that wrote it"
            )
        return False

    def _create_schema(self, db: sqlite_utils.Database) -> None:
        # One transaction: a crash half-way leaves an empty database, which the next open initialises.
        with db.atomic():
            db.conn.execute(_MESSAGES_DDL)
            db.conn.execute(_BATCHES_DDL)
            meta = db.table("meta")
            meta.create({"key": str, "value": str}, pk="key")
            meta.insert_all(
                [
                    {"key": "format", "value": FORMAT_MARKER},
                    {"key": "schema_version", "value": str(SCHEMA_VERSION)},
                    {"key": "created_ms", "value": str(time.time_ns() // 1_000_000)},
                ]
            )
        log.info("created outbox %s", self.path)

    def _upgrade(self, conn: sqlite3.Connection) -> None:
        """Schema version 1 -> 2: add the (empty) batches table; the messages table is unchanged."""
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'batches'").fetchone():
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_BATCHES_DDL)
            conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        log.info("outbox %s upgraded to schema version %d", self.path, SCHEMA_VERSION)

    def _load_batches(self, conn: sqlite3.Connection) -> None:
        """Rebuild the in-memory view of the batches table (nothing of it counts as delivered yet)."""
        self._batches = {}
        self._has_batches = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'batches'").fetchone() is not None
        if self._has_batches:
            for first, count, created_ms, size, sizes in conn.execute(
                    "SELECT first_seq, count, created_ms, length(payload), sizes FROM batches ORDER BY first_seq"):
                kept = _sizes_of(sizes) if self.max_bytes is not None else None
                self._batches[first] = _SpooledBatch(first, count, created_ms, size, set(), kept)
        self._batch_firsts = list(self._batches)

    def _batch_of(self, seq: int) -> _SpooledBatch | None:
        firsts = self._batch_firsts
        i = bisect.bisect_right(firsts, seq) - 1
        if i < 0:
            return None
        batch = self._batches[firsts[i]]
        return batch if seq <= batch.last else None

    def _load_totals(self, conn: sqlite3.Connection) -> None:
        self._load_batches(conn)
        pending = failed = total_bytes = 0
        for batch in self._batches.values():
            pending += batch.count
            total_bytes += batch.size
        for state, count, size in conn.execute(
            f"SELECT state, count(*), coalesce(sum({_SIZE_SQL}), 0) FROM messages GROUP BY state"
        ):
            if state == PENDING:
                pending += count
            elif state == FAILED:
                failed = count
            total_bytes += size
        self._pending, self._failed, self._bytes = pending, failed, total_bytes

    # ------------------------------------------------------------------ writing

    def _usable(self) -> None:
        if self._closed:
            raise OutboxError(f"outbox {self.path} is closed")

    def _writable(self) -> None:
        self._usable()
        if self.read_only:
            raise OutboxError(
                f"outbox {self.path} was opened read-only; open it without read_only=True (only while "
                "no producer owns it) to change it"
            )

    def _write_error(self, what: str, exc: sqlite3.Error) -> OutboxError:
        code = _primary_code(exc)
        if code == _SQLITE_FULL:
            advice = f"the disk holding {self.path.parent} is full; free space there or move the outbox"
        elif code in (_SQLITE_READONLY, _SQLITE_CANTOPEN):
            advice = f"{self.path} or its directory is read-only; fix permissions or choose a writable path"
        elif code == _SQLITE_IOERR:
            advice = f"the disk under {self.path} reported an I/O error; check the device and its filesystem"
        elif code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return self._corrupt(f"turned out damaged during {what} ({exc})")
        else:
            advice = "see the SQLite error above"
        return OutboxError(
            f"outbox {self.path}: {what} failed and was rolled back, nothing was written ({exc}); {advice}"
        )

    @contextlib.contextmanager
    def _transaction(self, what: str) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT; on any error everything is rolled back and the error explained."""
        conn = self._conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                try:
                    conn.execute("ROLLBACK")
                except sqlite3.Error:
                    log.exception("rollback of %s on outbox %s failed", what, self.path)
            if isinstance(exc, sqlite3.Error):
                raise self._write_error(what, exc) from exc
            raise

    def _over_bound(self, count: int, size: int) -> bool:
        rows = self._pending + self._failed
        if rows + count > self.max_messages:
            return True
        return self.max_bytes is not None and self._bytes + size > self.max_bytes

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
        plain = _plain_batch(messages) if self._has_batches else None
        if plain is not None:
            size = len(plain[3])
        else:
            rows, size = self._rows_of(messages, now_ms)
        count = len(messages)
        if count > self.max_messages or (self.max_bytes is not None and size > self.max_bytes):
            raise OutboxFull(
                f"a batch of {count} messages ({size} bytes) can never fit outbox {self.path} "
                f"(max_messages={self.max_messages}, max_bytes={self.max_bytes}); send smaller batches "
                "or raise the bound"
            )
        deadline = time.monotonic() + timeout
        with self._cond:
            self._writable()
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
                self._usable()
            with self._transaction("append") as conn:
                if plain is None:
                    conn.executemany(_INSERT_SQL, rows)
                    last = conn.execute("SELECT last_insert_rowid()").fetchone()[0]
                else:
                    # Reserve the batch's seqs from the messages table's AUTOINCREMENT sequence, which
                    # never hands out a seq at or below its value.
                    found = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'messages'").fetchone()
                    last = (found[0] if found else 0) + count
                    conn.execute("INSERT INTO batches VALUES (?, ?, ?, ?, ?, ?, ?)",
                                 (last - count + 1, count, plain[0], plain[1], _sizes_blob(plain[2]), plain[3],
                                  now_ms))
                    if found:
                        conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'messages'", (last,))
                    else:
                        conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('messages', ?)", (last,))
            if plain is not None:
                first = last - count + 1
                self._batches[first] = _SpooledBatch(first, count, now_ms, size, set(),
                                                     plain[2] if self.max_bytes is not None else None)
                self._batch_firsts.append(first)  # seqs only grow: the list stays sorted
            self._pending += count
            if self.max_bytes is not None:
                self._bytes += size
        # One writer inside one transaction: AUTOINCREMENT hands out consecutive seqs.
        return list(range(last - count + 1, last + 1))

    @staticmethod
    def _rows_of(messages: Sequence[NewMessage], now_ms: int) -> tuple[list[tuple[Any, ...]], int]:
        """The `messages` rows of a batch and their payload bytes (SerializationError for a bad one)."""
        rows = []
        size = 0
        try:
            for m in messages:
                headers = encode_headers(m.headers) if m.headers else None
                key, value = m.key, m.value
                if not (key is None or type(key) is bytes) or not (value is None or type(value) is bytes):
                    raise TypeError(f"key and value must be bytes or None, got {type(key)} / {type(value)}")
                size += _payload_size(key, value, headers)
                rows.append((m.message_id, m.topic, key, value, headers, m.partition, now_ms))
        except (TypeError, struct.error, UnicodeEncodeError) as exc:  # struct: a header name over 64 KiB
            raise SerializationError(f"cannot spool message {m.message_id}: {exc}") from exc
        return rows, size

    def _delete(self, conn: sqlite3.Connection, where: str, params: Sequence[object]) -> tuple[int, int]:
        """Delete the rows matching `where`: (rows deleted, their payload bytes when a byte bound is kept)."""
        freed = 0
        if self.max_bytes is not None:  # byte accounting costs one read of the rows about to go
            freed = conn.execute(
                f"SELECT coalesce(sum({_SIZE_SQL}), 0) FROM messages WHERE {where}", params
            ).fetchone()[0]
        return conn.execute(f"DELETE FROM messages WHERE {where}", params).rowcount, freed

    def _forget(self, pending: int, failed: int, freed: int) -> None:
        """Apply deleted rows to the running totals and wake appenders waiting for room."""
        if pending or failed:
            self._pending -= pending
            self._failed -= failed
            self._bytes -= freed
            self._cond.notify_all()

    def mark_delivered(self, seqs: Iterable[int]) -> None:
        """Remove delivered messages in one transaction; unknown seqs (already removed) are ignored."""
        wanted = list(seqs)
        if not wanted:
            return
        pending = failed = freed = 0
        with self._cond:
            self._writable()
            # Seqs of batch rows are noted in memory; a batch row goes once all of its messages are in.
            in_batches: dict[int, set[int]] = {}
            if self._batches:
                rows = []
                batch_of = self._batch_of
                for seq in wanted:
                    batch = batch_of(seq)
                    if batch is None:
                        rows.append(seq)
                    elif seq not in batch.done:
                        in_batches.setdefault(batch.first, set()).add(seq)
                wanted = rows
            complete = [first for first, seqs_in in in_batches.items()
                        if len(self._batches[first].done) + len(seqs_in) == self._batches[first].count]
            if not wanted and not complete:
                self._note_done(in_batches, complete)
                return
            with self._transaction("mark_delivered") as conn:
                for chunk in _chunks(complete):
                    conn.execute(f"DELETE FROM batches WHERE first_seq IN ({_placeholders(len(chunk))})", chunk)
                for chunk in _chunks(wanted):
                    in_chunk = f"seq IN ({_placeholders(len(chunk))})"
                    count, size = self._delete(conn, f"state = 'pending' AND {in_chunk}", chunk)
                    pending += count
                    freed += size
                    if count < len(chunk):
                        # Rare: a delivery report that came after mark_failed (the message is in Kafka
                        # after all), a repeated seq, or a seq already removed.
                        count, size = self._delete(conn, in_chunk, chunk)
                        failed += count
                        freed += size
            self._note_done(in_batches, complete)
            self._forget(pending, failed, freed)

    def _note_done(self, in_batches: dict[int, set[int]], complete: list[int]) -> None:
        """Apply delivered seqs of batch rows (after their transaction, if any, committed)."""
        delivered = freed = 0
        for first, seqs_in in in_batches.items():
            batch = self._batches[first]
            batch.done |= seqs_in
            delivered += len(seqs_in)
            if batch.sizes is not None:
                sizes = batch.sizes
                gone = sum(sizes[seq - first] for seq in seqs_in)
                batch.size -= gone
                freed += gone
        for first in complete:
            freed += self._forget_batch(first).size
        if delivered:
            self._pending -= delivered
            if self.max_bytes is not None:
                self._bytes -= freed
            self._cond.notify_all()

    def _forget_batch(self, first: int) -> _SpooledBatch:
        batch = self._batches.pop(first)
        del self._batch_firsts[bisect.bisect_left(self._batch_firsts, first)]
        return batch

    def _explode(self, conn: sqlite3.Connection, seqs: Iterable[int]) -> list[int]:
        """Give the undelivered messages of the batch rows holding `seqs` rows of their own (same seqs),
        inside the caller's transaction, so per-message changes (failed, attempts, purge) apply to them.
        Returns the batches' first seqs: pass them to _exploded() once the transaction committed."""
        firsts = sorted({batch.first for seq in seqs if (batch := self._batch_of(seq)) is not None})
        for first in firsts:
            found = conn.execute("SELECT topic, ids, sizes, payload, created_ms FROM batches WHERE first_seq = ?",
                                 (first,)).fetchone()
            if found is None:
                continue
            rows = _batch_rows(first, found[0], found[1], found[2], found[3], found[4], self._batches[first].done)
            conn.executemany(
                "INSERT INTO messages (seq, message_id, topic, key, value, headers, partition, created_ms) "
                "VALUES (?, ?, ?, NULL, ?, NULL, NULL, ?)",
                [(r.seq, r.message_id, r.topic, r.value, r.created_ms) for r in rows],
            )
            conn.execute("DELETE FROM batches WHERE first_seq = ?", (first,))
        return firsts

    def _exploded(self, firsts: list[int]) -> None:
        """The batch rows are gone and their undelivered messages are rows of their own: counts and
        bytes stay as they are (a batch's delivered messages were subtracted as they came in)."""
        for first in firsts:
            self._forget_batch(first)

    def mark_failed(self, seq: int, reason: str) -> None:
        """Park a message Kafka refused for good: state=failed, last_error=reason, attempts+1."""
        with self._cond:
            self._writable()
            with self._transaction("mark_failed") as conn:
                exploded = self._explode(conn, (seq,))
                found = conn.execute("SELECT state FROM messages WHERE seq = ?", (seq,)).fetchone()
                if found is not None:
                    conn.execute(
                        "UPDATE messages SET state = 'failed', last_error = ?, attempts = attempts + 1 "
                        "WHERE seq = ?",
                        (reason, seq),
                    )
            self._exploded(exploded)
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
            self._writable()
            with self._transaction("record_attempt") as conn:
                exploded = self._explode(conn, (seq for _, seq in params))
                conn.executemany(
                    "UPDATE messages SET attempts = attempts + 1, last_error = ? WHERE seq = ?", params
                )
            self._exploded(exploded)

    def retry_failed(self, seqs: Iterable[int] | None = None) -> int:
        """Move failed messages (all, or those in `seqs`) back to pending, keeping their seq; count them."""
        with self._cond:
            self._writable()
            moved = 0
            with self._transaction("retry_failed") as conn:
                for where, params in self._selection(FAILED, seqs):
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
        if state not in _STATES:
            raise ValueError(f"state must be one of {_STATES}, got {state!r}")
        purged = freed = 0
        with self._cond:
            self._writable()
            wanted = None if seqs is None else list(seqs)
            with self._transaction("purge") as conn:
                exploded: list[int] = []
                if state == PENDING:
                    if wanted is None:  # every pending message: the batch rows go whole
                        conn.execute("DELETE FROM batches")
                        purged += sum(b.count - len(b.done) for b in self._batches.values())
                        freed += sum(b.size for b in self._batches.values())
                    else:
                        exploded = self._explode(conn, wanted)
                for where, params in self._selection(state, wanted):
                    count, size = self._delete(conn, where, params)
                    purged += count
                    freed += size
            if state == PENDING and wanted is None:
                self._batches.clear()
                self._batch_firsts.clear()
            self._exploded(exploded)
            if state == PENDING:
                self._forget(purged, 0, freed)
            else:
                self._forget(0, purged, freed)
        if purged:
            log.warning("outbox %s: purged %d %s message(s) on request", self.path, purged, state)
        return purged

    @staticmethod
    def _selection(state: str, seqs: Iterable[int] | None) -> Iterator[tuple[str, Sequence[object]]]:
        """WHERE clauses (with parameters) for rows in `state`, optionally restricted to `seqs`."""
        if seqs is None:
            yield "state = ?", (state,)
            return
        for chunk in _chunks(list(seqs)):
            yield f"state = ? AND seq IN ({_placeholders(len(chunk))})", (state, *chunk)

    # ------------------------------------------------------------------ reading

    @staticmethod
    def _row(raw: Any) -> OutboxRow:
        return OutboxRow(
            seq=raw[0],
            message_id=raw[1],
            topic=raw[2],
            key=raw[3],
            value=raw[4],
            headers=decode_headers(raw[5]),
            partition=raw[6],
            state=raw[7],
            attempts=raw[8],
            last_error=raw[9],
            created_ms=raw[10],
        )

    def _query(self, sql: str, params: Sequence[object]) -> list[OutboxRow]:
        with self._cond:
            self._usable()
            try:
                raw = self._conn.execute(sql, params).fetchall()
            except sqlite3.Error as exc:
                raise OutboxError(f"cannot read outbox {self.path}: {exc}") from exc
        return [self._row(r) for r in raw]

    def pending(self, *, after_seq: int = 0, limit: int | None = None) -> list[OutboxRow]:
        """Pending messages with seq > `after_seq`, in seq order (the order they were appended)."""
        with self._cond:
            self._usable()
            try:
                raw = self._conn.execute(
                    f"SELECT {_COLUMNS} FROM messages WHERE state = 'pending' AND seq > ? ORDER BY seq LIMIT ?",
                    (after_seq, -1 if limit is None else limit),
                ).fetchall()
                from_batches = self._pending_in_batches(after_seq, limit)
            except sqlite3.Error as exc:
                raise OutboxError(f"cannot read outbox {self.path}: {exc}") from exc
        rows = [self._row(r) for r in raw]
        if from_batches:
            rows = sorted(rows + from_batches, key=lambda r: r.seq)[:limit]
        return rows

    def _pending_in_batches(self, after_seq: int, limit: int | None, only: int | None = None) -> list[OutboxRow]:
        """Undelivered messages of batch rows with seq > after_seq (at least `limit` of them, when there
        are), or just seq `only`. Called with the lock held."""
        if self.read_only:  # the owning producer changes the file under us
            self._load_batches(self._conn)
        firsts = self._batch_firsts
        if not firsts:
            return []
        rows: list[OutboxRow] = []
        for first in firsts[max(0, bisect.bisect_right(firsts, after_seq) - 1):]:
            if limit is not None and len(rows) >= limit:
                break
            batch = self._batches[first]
            if batch.last <= after_seq:
                continue
            if only is not None and not batch.first <= only <= batch.last:
                continue
            found = self._conn.execute(
                "SELECT topic, ids, sizes, payload, created_ms FROM batches WHERE first_seq = ?", (first,)
            ).fetchone()
            if found is not None:
                rows.extend(_batch_rows(first, found[0], found[1], found[2], found[3], found[4], batch.done,
                                        after_seq, only))
            if only is not None:
                break
        return rows

    def get(self, seq: int) -> OutboxRow | None:
        """The row with this seq in any state, or None once it was delivered (or purged)."""
        with self._cond:
            self._usable()
            try:
                raw = self._conn.execute(f"SELECT {_COLUMNS} FROM messages WHERE seq = ?", (seq,)).fetchone()
                if raw is not None:
                    return self._row(raw)
                found = self._pending_in_batches(seq - 1, None, only=seq)
            except sqlite3.Error as exc:
                raise OutboxError(f"cannot read outbox {self.path}: {exc}") from exc
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
        return self._query(
            f"SELECT {_COLUMNS} FROM messages WHERE state = 'failed' ORDER BY seq LIMIT ?",
            (-1 if limit is None else limit,),
        )

    def stats(self) -> OutboxStats:
        """Cheap counts: in-memory totals for the owner, a fresh count for a read-only viewer."""
        with self._cond:
            self._usable()
            try:
                if self.read_only:  # the owning producer changes the file under us
                    self._load_totals(self._conn)
                oldest = self._conn.execute(
                    "SELECT created_ms FROM messages WHERE state = 'pending' ORDER BY seq LIMIT 1"
                ).fetchone()
            except sqlite3.Error as exc:
                raise OutboxError(f"cannot read outbox {self.path}: {exc}") from exc
            pending, failed = self._pending, self._failed
            created = [oldest[0]] if oldest is not None else []
            if self._batch_firsts:
                created.append(self._batches[self._batch_firsts[0]].created_ms)
        age = None if not created else max(0.0, (time.time_ns() // 1_000_000 - min(created)) / 1000)
        file_bytes = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                file_bytes += os.stat(f"{self.path}{suffix}").st_size
        return OutboxStats(
            pending=pending,
            failed=failed,
            oldest_pending_age_s=age,
            file_bytes=file_bytes,
            max_messages=self.max_messages,
        )

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the database (checkpointing the WAL), release the lock; appenders waiting for room fail."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            try:
                self._conn.close()
            finally:
                if self._lock is not None:
                    self._lock.release()
        log.info("outbox %s closed", self.path)

    def __enter__(self) -> Outbox:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
