"""SQLite dedup store: done keys, claims and partition leases in one WAL-mode file, shared by processes on one host.

Every write is one BEGIN IMMEDIATE transaction, so two processes never both claim a key nor both hold a
partition's lease; inbox mode commits the application's own rows and the done keys in one transaction.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from reliable_kafka.dedup.base import (
    DEFAULT_RETENTION_S,
    ClaimResult,
    FencedDedupStore,
    PartitionLease,
    distinct_keys,
    lease_ms,
    lost_leases,
    retention_ms,
)
from reliable_kafka.errors import DedupStoreUnavailable, PartitionFenced

logger = logging.getLogger(__name__)

# Keyed by the key alone, WITHOUT ROWID and without an index on expiry: one b-tree write per recorded key
# (a rowid table with an expiry index took three, and recorded keys half as fast). Expired rows go by a
# purge that walks the keys in chunks instead (see _purge_chunk).
TABLE = "rk_dedup_keys"
LEGACY_TABLE = "rk_dedup"  # the layout before the partition fence: its rows are moved over on open
LEASES = "rk_dedup_leases"
_CLAIMED = "claimed"
_DONE = "done"

_CREATE = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} (key TEXT PRIMARY KEY NOT NULL, state TEXT NOT NULL,"
    " owner TEXT NOT NULL, expires_ms INTEGER NOT NULL) WITHOUT ROWID",
    f"CREATE TABLE IF NOT EXISTS {LEASES} (grp TEXT NOT NULL, topic TEXT NOT NULL, partition INTEGER NOT NULL,"
    " owner TEXT NOT NULL, epoch INTEGER NOT NULL, PRIMARY KEY (grp, topic, partition)) WITHOUT ROWID",
)

# Keys travel as one JSON array parameter: a batch of any size is one statement, with no limit on the
# number of SQL variables and no per-key round trip through the sqlite3 module.
_IN_BATCH = "key IN (SELECT value FROM json_each(:keys))"

_SELECT_STATE = f"SELECT key, state, expires_ms FROM {TABLE} WHERE {_IN_BATCH}"

# `WHERE true` is required by SQLite's grammar to tell an upsert's ON CONFLICT from a join clause.
_UPSERT = (
    f"INSERT INTO {TABLE} (key, state, owner, expires_ms)"
    " SELECT value, :state, :owner, :expires_ms FROM json_each(:keys) WHERE true"
    " ON CONFLICT (key) DO UPDATE SET"
    " state = excluded.state, owner = excluded.owner, expires_ms = excluded.expires_ms"
)

_CONFIRM_OWN = f"UPDATE {TABLE} SET state = '{_DONE}', expires_ms = :expires_ms WHERE {_IN_BATCH} AND owner = :owner"

_COUNT_TAKEN_OVER = (
    f"SELECT count(*) FROM {TABLE} WHERE {_IN_BATCH}"
    f" AND state = '{_CLAIMED}' AND owner != :owner AND expires_ms > :now"
)

_RELEASE = f"DELETE FROM {TABLE} WHERE {_IN_BATCH} AND state = '{_CLAIMED}' AND owner = :owner"

_CHUNK_END = f"SELECT max(key) FROM (SELECT key FROM {TABLE} WHERE key > :after ORDER BY key LIMIT :n)"
_PURGE_CHUNK = f"DELETE FROM {TABLE} WHERE key > :after AND key <= :last AND expires_ms <= :now"

_COUNT_DONE = f"SELECT count(*) FROM {TABLE} WHERE {_IN_BATCH} AND state = '{_DONE}' AND expires_ms > :now"
_DONE_KEYS = f"SELECT key FROM {TABLE} WHERE {_IN_BATCH} AND state = '{_DONE}' AND expires_ms > :now"

# The newest acquirer wins: the epoch only grows, so a lease taken earlier (by anyone) no longer matches.
_ACQUIRE = (
    f"INSERT INTO {LEASES} (grp, topic, partition, owner, epoch) VALUES (:grp, :topic, :partition, :owner, 1)"
    f" ON CONFLICT (grp, topic, partition) DO UPDATE SET owner = excluded.owner, epoch = {LEASES}.epoch + 1"
    " RETURNING epoch"
)
_HOLDERS = (
    f"SELECT grp, topic, partition, owner, epoch FROM {LEASES} WHERE grp IN (SELECT value FROM json_each(:groups))"
)

# Rolls an inbox block back inside its transaction when its keys were already done.
_SKIP_SAVEPOINT = "rk_inbox_already_done"


def _now_ms() -> int:
    # Wall-clock time, not monotonic: leases are compared across processes sharing the file.
    return time.time_ns() // 1_000_000


class SQLiteInbox:
    """One open inbox transaction: write the effect through ``conn``; the inbox's keys are confirmed with it.

    Do not call ``conn.commit()`` or ``conn.rollback()``: the ``with`` block commits (or rolls back) the
    application's rows and the confirmations together. ``already_done`` is True when every key passed
    to ``inbox(keys)`` was confirmed before the block began: the block's writes are then rolled back.
    """

    def __init__(self, store: SQLiteDedupStore, conn: sqlite3.Connection, *, already_done: bool = False) -> None:
        self._store = store
        self.conn = conn
        self.already_done = already_done

    def confirm(self, keys: Sequence[str]) -> None:
        """Record more keys as done in this transaction: they count only if the block commits."""
        self._store.confirm(keys)


class SQLiteDedupStore(FencedDedupStore):
    """A dedup store in a SQLite file (WAL mode), usable by several processes and threads at once.

    Durability: WAL with ``synchronous=NORMAL`` keeps every committed claim and confirmation across a
    crash of the process; a power loss can forget the last few, which can let a redelivered message run
    again. Use a file on a local disk (network file systems break SQLite's locking).

    Inbox mode makes the effect and the dedup record one atomic write when the effect is a write to the
    same SQLite file (keep the application's tables in the store's file)::

        result = store.claim(keys)
        with store.inbox(keys_handled) as tx:
            tx.conn.execute("INSERT INTO orders ...")

    Either both commit or, on any exception inside the block, neither does; a crash in between leaves
    neither, and the key's claim simply expires. An inbox whose keys are all done already writes
    nothing (see ``inbox``), so its effect is applied once even when a lease ran out. Store methods
    called on the same thread inside the block join its transaction; other threads wait until it ends
    (one connection per store).

    The partition fence (``acquire`` / ``seen`` / ``record_done``, see ``FencedDedupStore``) is what
    ReliableConsumer uses when it runs one record at a time: one write transaction per batch that checks
    the partition's lease and records the keys. An inbox of a store that holds leases checks them too,
    and refuses (``PartitionFenced``) once one was taken over. Use one store per consumer for the fence.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        retention_s: float = DEFAULT_RETENTION_S,
        busy_timeout_s: float = 5.0,
        purge_every: int = 10_000,
    ) -> None:
        """Open (creating if needed) the store at ``path``.

        ``retention_s``: how long a confirmed key is remembered (duplicates older than that pass).
        ``busy_timeout_s``: how long a batch waits for another process's write lock before the store is
        reported unavailable. ``purge_every``: after this many confirmed keys, the next ``2 * purge_every``
        rows (in key order, wrapping around) are looked at and the expired ones deleted.
        """
        self.path = os.fspath(path)
        self.owner = uuid.uuid4().hex
        self._retention_ms = retention_ms(retention_s)
        self._busy_timeout_s = busy_timeout_s
        self._purge_every = purge_every
        self._confirmed_since_purge = 0
        self._purge_after = ""  # where the next purge chunk starts, in key order ("": the start)
        self._held: dict[tuple[str, str, int], PartitionLease] = {}  # the leases this store took and holds
        # Reentrant so that store calls inside an inbox block on the same thread join its transaction.
        self._lock = threading.RLock()
        self._depth = 0
        self._closed = False
        self._conn = self._open()

    def _open(self) -> sqlite3.Connection:
        try:
            # isolation_level=None: the store issues BEGIN IMMEDIATE itself; Python's implicit deferred
            # BEGIN would take the write lock late and fail with SQLITE_BUSY instead of waiting.
            conn = sqlite3.connect(
                self.path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise self._unavailable("open the file", exc) from exc
        try:
            tables = {name for (name,) in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN (?, ?, ?)",
                (TABLE, LEASES, LEGACY_TABLE))}
            if tables == {TABLE, LEASES}:
                # A store opened before (every restart of its consumer): WAL is kept in the file, one
                # pragma, and sqlite-utils, which imports pandas when installed (~0.8 s of CPU), stays unloaded.
                conn.execute("PRAGMA journal_mode=wal")
            else:
                # Imported here, not at module level: sqlite-utils pulls in click, and pandas/numpy when they
                # are installed, which `import reliable_kafka` must not pay for a store it may never open.
                from sqlite_utils import Database

                db = Database(conn)
                db.enable_wal()
                for statement in _CREATE:
                    conn.execute(statement)
                if db[LEGACY_TABLE].exists():
                    _migrate(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error as exc:
            conn.close()
            raise self._unavailable("open the file", exc) from exc
        return conn

    def _unavailable(self, action: str, exc: BaseException) -> DedupStoreUnavailable:
        return DedupStoreUnavailable(
            f"SQLite dedup store {self.path!r} could not {action}: {str(exc).rstrip('.')}."
            " The consumer holds its progress (fail-closed) until the store works again: check that the"
            " file is on a local disk, writable, not corrupt, and not kept locked by another process for"
            f" longer than busy_timeout_s={self._busy_timeout_s}."
        )

    def _check_open(self, action: str) -> None:
        if self._closed:
            raise DedupStoreUnavailable(
                f"SQLite dedup store {self.path!r} is closed; could not {action}. Open a new store."
            )

    @contextmanager
    def _transaction(self, action: str, *, own_statements: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction (a savepoint inside an inbox block); SQLite errors become unavailability.

        ``own_statements=False`` lets errors raised by the block pass unchanged: in inbox mode they come
        from the application's statements, which are not a store failure.
        """
        with self._lock:
            self._check_open(action)
            nested = self._depth > 0
            try:
                self._conn.execute("SAVEPOINT rk_dedup" if nested else "BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._unavailable(action, exc) from exc
            self._depth += 1
            try:
                yield self._conn
            except sqlite3.Error as exc:
                self._undo(nested)
                if own_statements:
                    raise self._unavailable(action, exc) from exc
                raise
            except BaseException:
                self._undo(nested)
                raise
            finally:
                self._depth -= 1
            try:
                self._conn.execute("RELEASE rk_dedup" if nested else "COMMIT")
            except sqlite3.Error as exc:
                self._undo(nested)
                raise self._unavailable(action, exc) from exc

    def _undo(self, nested: bool) -> None:
        # SQLite rolls a transaction back by itself after some errors (disk full, I/O): then there is
        # nothing left to undo, and trying would hide the original error.
        if not self._conn.in_transaction:
            return
        try:
            if nested:
                self._conn.execute("ROLLBACK TO rk_dedup")
                self._conn.execute("RELEASE rk_dedup")
            else:
                self._conn.execute("ROLLBACK")
        except sqlite3.Error:
            logger.exception("rollback failed on SQLite dedup store %s", self.path)

    def claim(self, keys: Sequence[str], lease_s: float = 30.0) -> ClaimResult:
        """Reserve the keys that are free or whose lease/retention ran out; one transaction per batch."""
        lease = lease_ms(lease_s)
        batch = distinct_keys(keys)
        if not batch:
            return ClaimResult(frozenset(), frozenset(), frozenset())
        with self._transaction("claim keys") as conn:
            # Read the clock under the write lock, so every process compares leases in commit order.
            now = _now_ms()
            rows = conn.execute(_SELECT_STATE, {"keys": json.dumps(batch)}).fetchall()
            live = {key: state for key, state, expires_ms in rows if expires_ms > now}
            claimed = [key for key in batch if key not in live]
            if claimed:
                conn.execute(
                    _UPSERT,
                    {
                        "state": _CLAIMED,
                        "owner": self.owner,
                        "expires_ms": now + lease,
                        "keys": json.dumps(claimed),
                    },
                )
        return ClaimResult(
            claimed=frozenset(claimed),
            done=frozenset(key for key, state in live.items() if state == _DONE),
            busy=frozenset(key for key, state in live.items() if state == _CLAIMED),
        )

    def confirm(self, keys: Sequence[str]) -> None:
        """Record the keys as done for ``retention_s``, whatever their claim state.

        The handler already ran, so done is the truth even when the lease expired meanwhile and another
        consumer claimed the key: that consumer's confirm or release then changes nothing. Such takeovers
        are logged, because they mean the lease is shorter than the handler.
        """
        batch = distinct_keys(keys)
        if not batch:
            return
        payload = json.dumps(batch)
        with self._transaction("confirm keys") as conn:
            now = _now_ms()
            expires_ms = now + self._retention_ms
            taken_over = 0
            # The usual batch holds only this store's own claims: one UPDATE, no takeover to count.
            own = conn.execute(_CONFIRM_OWN, {"keys": payload, "owner": self.owner, "expires_ms": expires_ms})
            if own.rowcount != len(batch):
                (taken_over,) = conn.execute(
                    _COUNT_TAKEN_OVER, {"keys": payload, "owner": self.owner, "now": now}
                ).fetchone()
                conn.execute(
                    _UPSERT, {"state": _DONE, "owner": self.owner, "expires_ms": expires_ms, "keys": payload}
                )
            purge_due = self._count_for_purge(len(batch))
        if taken_over:
            logger.warning(
                "confirmed %d key(s) that another consumer had claimed after this one's lease expired;"
                " the handler may have run twice: raise lease_s above the longest handler time",
                taken_over,
            )
        if purge_due:
            self._purge_chunk(2 * self._purge_every)

    def release(self, keys: Sequence[str]) -> None:
        """Delete this store's claims on the keys (live or expired); done keys and other owners' stay."""
        batch = distinct_keys(keys)
        if not batch:
            return
        with self._transaction("release keys") as conn:
            conn.execute(_RELEASE, {"keys": json.dumps(batch), "owner": self.owner})

    def purge_expired(self) -> int:
        """Delete every expired claim and confirmation past retention; returns how many rows went.

        One chunk of keys per transaction, so other writers wait for a chunk, never for the whole file.
        """
        self._purge_after = ""
        deleted = 0
        while True:
            deleted += self._purge_chunk(self._purge_every)
            if not self._purge_after:
                return deleted

    def _count_for_purge(self, recorded: int) -> bool:
        self._confirmed_since_purge += recorded
        return self._confirmed_since_purge >= self._purge_every

    def _purge_chunk(self, rows: int) -> int:
        """Look at the next `rows` keys after the cursor and delete the expired ones; at the end, wrap.

        No index on expiry (it would cost every recorded key a second b-tree write): a chunk twice the
        number of keys recorded since the last one keeps the walk ahead of the writes.
        """
        with self._transaction("purge expired keys") as conn:
            after = self._purge_after
            (last,) = conn.execute(_CHUNK_END, {"after": after, "n": max(1, rows)}).fetchone()
            deleted = 0
            if last is not None:
                deleted = conn.execute(_PURGE_CHUNK, {"after": after, "last": last, "now": _now_ms()}).rowcount
            self._purge_after = last or ""
            self._confirmed_since_purge = 0
        logger.debug("purged %d expired dedup rows from %s", deleted, self.path)
        return deleted

    # ---- the partition fence (FencedDedupStore) -------------------------------------------

    def acquire(self, group: str, topic: str, partition: int) -> PartitionLease:
        """Take the partition's lease for this store; whoever held it before has lost it."""
        with self._transaction(f"take the lease of {topic}[{partition}]") as conn:
            (epoch,) = conn.execute(
                _ACQUIRE, {"grp": group, "topic": topic, "partition": partition, "owner": self.owner}
            ).fetchone()
        lease = PartitionLease(group, topic, partition, epoch)
        with self._lock:
            self._held[lease.where] = lease
        return lease

    def drop(self, leases: Iterable[PartitionLease]) -> None:
        """Forget leases this store held (revoked, lost or fenced partitions): inboxes stop checking them."""
        with self._lock:
            for lease in leases:
                if self._held.get(lease.where) == lease:
                    del self._held[lease.where]

    def seen(
        self, keys: Sequence[str], leases: Iterable[PartitionLease]
    ) -> tuple[frozenset[str], list[PartitionLease]]:
        """The keys already done, and the leases lost to another consumer; reads, no write lock."""
        batch = distinct_keys(keys)
        with self._lock:
            self._check_open("read done keys")
            try:
                done: frozenset[str] = frozenset()
                if batch:
                    rows = self._conn.execute(_DONE_KEYS, {"keys": json.dumps(batch), "now": _now_ms()})
                    done = frozenset(key for (key,) in rows)
                lost = self._lost(self._conn, leases)
            except sqlite3.Error as exc:
                raise self._unavailable("read done keys", exc) from exc
        return done, lost

    def record_done(self, keys: Mapping[PartitionLease, Sequence[str]]) -> list[PartitionLease]:
        """Record the keys of each live lease as done in ONE transaction that also checks the leases.

        Keys of a lost lease are not recorded: the partition's new owner decides about them. Returns the
        lost leases; the caller must not commit their offsets.
        """
        if not keys:
            return []
        with self._transaction("record done keys") as conn:
            lost = self._lost(conn, keys)
            live = [key for lease, batch in keys.items() if lease not in lost for key in batch]
            if live:
                conn.execute(
                    _UPSERT,
                    {
                        "state": _DONE,
                        "owner": self.owner,
                        "expires_ms": _now_ms() + self._retention_ms,
                        "keys": json.dumps(live),
                    },
                )
            purge_due = self._count_for_purge(len(live))
        if purge_due:
            self._purge_chunk(2 * self._purge_every)
        return lost

    def _lost(self, conn: sqlite3.Connection, leases: Iterable[PartitionLease]) -> list[PartitionLease]:
        leases = list(leases)
        if not leases:
            return []
        groups = sorted({lease.group for lease in leases})
        holders = {
            (grp, topic, partition): (owner, epoch)
            for grp, topic, partition, owner, epoch in conn.execute(_HOLDERS, {"groups": json.dumps(groups)})
        }
        return lost_leases(leases, holders, self.owner)

    def _fenced(self, lost: list[PartitionLease]) -> PartitionFenced:
        where = ", ".join(f"{lease.topic}[{lease.partition}] of group {lease.group!r}" for lease in lost)
        return PartitionFenced(
            f"the dedup lease of {where} in {self.path!r} was taken over by another consumer: this one lost"
            " the partition (paused or cut off past session.timeout.ms) and writes nothing for it until the"
            " group assigns it again. If it repeats, raise session.timeout.ms / max.poll.interval.ms above"
            " the longest pause of this process.",
            partitions=[(lease.topic, lease.partition) for lease in lost],
        )

    @contextmanager
    def inbox(self, keys: Sequence[str] = ()) -> Iterator[SQLiteInbox]:
        """A transaction holding the application's writes and the confirmation of ``keys``: both or neither.

        The transaction holds the write lock from the start, so checking the keys and committing are
        one step: if every key is already done (another consumer applied the effect after this one's
        lease ran out), the block's writes are rolled back and ``tx.already_done`` is True. Keys can
        also be confirmed inside the block with ``tx.confirm``. The exception that aborted the block is
        re-raised unchanged after the rollback; failures to begin or commit raise
        ``DedupStoreUnavailable``. A store holding partition leases (the consumer's fence) first checks
        them: one taken over by another consumer raises ``PartitionFenced`` before the block runs.
        """
        batch = distinct_keys(keys)
        with self._transaction("run an inbox transaction", own_statements=False) as conn:
            done = 0
            if self._held:
                try:
                    lost = self._lost(conn, list(self._held.values()))
                except sqlite3.Error as exc:
                    raise self._unavailable("run an inbox transaction", exc) from exc
                if lost:
                    raise self._fenced(lost)
            if batch:
                try:
                    (done,) = conn.execute(
                        _COUNT_DONE, {"keys": json.dumps(batch), "now": _now_ms()}
                    ).fetchone()
                    if done == len(batch):
                        conn.execute(f"SAVEPOINT {_SKIP_SAVEPOINT}")
                except sqlite3.Error as exc:
                    raise self._unavailable("run an inbox transaction", exc) from exc
            tx = SQLiteInbox(self, conn, already_done=bool(batch) and done == len(batch))
            yield tx
            if tx.already_done:
                logger.debug("inbox keys %s were already done; their writes are rolled back", batch[:5])
                try:
                    conn.execute(f"ROLLBACK TO {_SKIP_SAVEPOINT}")
                    conn.execute(f"RELEASE {_SKIP_SAVEPOINT}")
                except sqlite3.Error as exc:
                    raise self._unavailable("run an inbox transaction", exc) from exc
                return
            self.confirm(batch)
        if done:
            logger.warning(
                "inbox confirmed %d key(s) that were already done; their effect may be applied twice:"
                " keep the keys of one effect together",
                done,
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._conn.close()


def _migrate(conn: sqlite3.Connection) -> None:
    """Move the rows of a store file written before the partition fence into the current table, once."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Checked again under the write lock: another process opening the file may have moved them first.
        if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (LEGACY_TABLE,)).fetchone():
            conn.execute(
                f"INSERT OR IGNORE INTO {TABLE} (key, state, owner, expires_ms)"
                f" SELECT key, state, owner, expires_ms FROM {LEGACY_TABLE}"
            )
            conn.execute(f"DROP TABLE {LEGACY_TABLE}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
