"""Opening an outbox file: for its one owner (locked, checked, WAL, schema current) or for a read-only
viewer; the connection, its transactions and closing.

A file that fails its checks is refused and never changed; every write runs in one BEGIN IMMEDIATE
transaction that is rolled back whole on any error, which is explained by sqlite_errors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from reliable_kafka.errors import ConfigError, OutboxCorrupt, OutboxError
from reliable_kafka.outbox import schema
from reliable_kafka.outbox.lock import OutboxLock
from reliable_kafka.outbox.sqlite_errors import read_error, write_error
from reliable_kafka.spool import Durability

if TYPE_CHECKING:
    import sqlite_utils

log = logging.getLogger("reliable_kafka.outbox")

_SYNCHRONOUS = {Durability.PROCESS: "NORMAL", Durability.FSYNC: "FULL"}
# What a transaction that need not survive a power loss switches an "fsync" outbox to (see transaction()).
_LAZY = "NORMAL"


def parse_durability(durability: Durability | str) -> Durability:
    """The durability of a file-backed outbox; ConfigError for an unknown one and for "memory"."""
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


def _database(conn: sqlite3.Connection) -> sqlite_utils.Database:
    # Imported on first use: sqlite-utils pulls in pandas when it is installed (~0.6 s, tens of MB),
    # a cost that producers in "memory" mode, which never open an outbox, should not pay.
    import sqlite_utils

    return sqlite_utils.Database(conn, execute_plugins=False)


class OutboxFile:
    """One open outbox file and its SQLite connection; not thread-safe (the Outbox's lock guards it).

    Writable: takes the file's lock first (OutboxLocked while another process owns it), creates or
    upgrades the schema. Read-only: takes no lock and changes nothing.
    """

    def __init__(self, path: Path, durability: Durability, *, read_only: bool) -> None:
        self.path = path
        self.read_only = read_only
        self.closed = False
        self._lock: OutboxLock | None = None
        # "fsync": every transaction syncs unless it says it may be lost (transaction(lazy=True)).
        self._full = durability is Durability.FSYNC and not read_only
        if read_only:
            self.conn = self._open_read_only()
        else:
            self._lock = OutboxLock(path)
            try:
                self.conn = self._open_writable(durability)
            except BaseException:
                self._lock.release()
                raise

    def _open_read_only(self) -> sqlite3.Connection:
        if not self.path.exists():
            raise OutboxError(f"no such outbox: {self.path} does not exist (check the --path)")
        if self._probe():
            raise OutboxCorrupt(
                f"{self.path} is an empty SQLite file without outbox tables: a producer may be "
                "creating it right now; retry in a moment"
            )
        return self._connect(read_only=True)

    def _open_writable(self, durability: Durability) -> sqlite3.Connection:
        fresh = True
        if self.path.exists() and self.path.stat().st_size > 0:
            fresh = self._probe()
        elif not self.path.parent.is_dir():
            raise OutboxError(
                f"cannot create outbox {self.path}: directory {self.path.parent} does not exist"
            )
        conn = self._connect(read_only=False)
        try:
            if fresh:
                db = _database(conn)
                db.enable_wal()
                mode = db.journal_mode
            else:
                # The WAL mode is kept in the file: reopening an outbox (every restart of its producer)
                # takes one pragma and does not load sqlite-utils, which imports pandas when that is
                # installed (~0.8 s of CPU per process start here).
                mode = conn.execute("PRAGMA journal_mode=wal").fetchone()[0]
            # journal_mode=wal is refused silently on a read-only file or filesystem; say so now
            # rather than on the first send.
            if mode != "wal" or (self.path.exists() and not os.access(self.path, os.W_OK)):
                raise OutboxError(
                    f"outbox {self.path} is not writable (read-only file or filesystem); fix its "
                    "permissions or choose a writable path"
                )
            conn.execute(f"PRAGMA synchronous={_SYNCHRONOUS[durability]}")
            if fresh:
                schema.create(self.path, db)
            else:
                schema.upgrade(self.path, conn)
        except sqlite3.Error as exc:
            conn.close()
            raise write_error(self.path, "open", exc) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _probe(self) -> bool:
        """Check the existing file without changing it; True when it is an empty SQLite database.

        Closing a read-write connection can checkpoint a WAL into the file, and even a read-only one
        creates -wal/-shm files for a WAL-mode header; so when no WAL is left over the check reads the
        file as immutable, which touches nothing at all.
        """
        has_wal = Path(f"{self.path}-wal").exists()
        probe = self._connect(read_only=True, immutable=not has_wal)
        try:
            return schema.check(self.path, probe)
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

    def open_error(self, exc: sqlite3.Error) -> OutboxError:
        """The error for a SQLite failure while the file was being opened (reading its contents)."""
        return read_error(self.path, exc) if self.read_only else write_error(self.path, "open", exc)

    # ------------------------------------------------------------------ use

    def usable(self) -> None:
        if self.closed:
            raise OutboxError(f"outbox {self.path} is closed")

    def writable(self) -> None:
        self.usable()
        if self.read_only:
            raise OutboxError(
                f"outbox {self.path} was opened read-only; open it without read_only=True (only while "
                "no producer owns it) to change it"
            )

    @contextlib.contextmanager
    def transaction(self, what: str, *, lazy: bool = False) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE … COMMIT; on any error everything is rolled back and the error explained.

        `lazy`: a transaction whose loss on a power cut only repeats work (removing delivered messages: they
        come back and are sent again, a duplicate their rk-id tells apart, never a loss) commits without
        a sync in durability "fsync" too. WAL keeps the order: the next synced commit, or the checkpoint,
        makes it durable along with everything before it, and a power cut rolls back a tail of whole
        transactions. Why: the poller removes each poll round's deliveries, and that commit's fsync held
        the outbox's lock for 1.3-2.1 ms on average while concurrent send()s waited to append (16 threads,
        one send() per message: ~1,000 removals per 100,000 messages, a fifth of the run).
        """
        conn = self.conn
        relax = lazy and self._full
        try:
            if relax:
                conn.execute(f"PRAGMA synchronous={_LAZY}")  # outside a transaction, as SQLite requires
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
                raise write_error(self.path, what, exc) from exc
            raise
        finally:
            if relax:
                with contextlib.suppress(sqlite3.Error):  # a closed connection: nothing to restore
                    conn.execute(f"PRAGMA synchronous={_SYNCHRONOUS[Durability.FSYNC]}")

    def bytes_on_disk(self) -> int:
        """The file's size plus its WAL's."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    def close(self) -> None:
        """Close the connection (checkpointing the WAL) and release the lock; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.conn.close()
        finally:
            if self._lock is not None:
                self._lock.release()
