"""The outbox file's format: its tables, its marker and version, and the checks that refuse anything else.

A file is used only when it passes check() (SQLite's integrity check, our tables, our marker, a version
we read); create() and upgrade() each run in one transaction, so a crash half-way leaves a usable file.

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
  ``schema_version`` says how to read it; ``journal_settled_seq`` (durability "process") says that every
  record of the accept journal with a seq up to it is a row or was delivered.
- Beside the file, ``<outbox>.journal.N``: the accept journal's segments (layout in journal.py). A file
  with segments next to it must be opened by a version that reads them (one that does not would leave
  their messages unsent).
- ``headers`` encoding: NULL for no headers, otherwise for each (name, value) pair in order a big-endian
  ``uint16`` name length, ``uint32`` value length, the UTF-8 name bytes, then the value bytes.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING

from reliable_kafka.errors import OutboxError
from reliable_kafka.outbox.sqlite_errors import corrupt, is_damage, read_error

if TYPE_CHECKING:
    import sqlite_utils

log = logging.getLogger("reliable_kafka.outbox")  # one logger for the whole outbox, as before its split

FORMAT_MARKER = "reliable-kafka-outbox"
SCHEMA_VERSION = 2
_READABLE_VERSIONS = ("1", "2")  # 1: no batches table; upgraded to 2 when a producer opens it

SQLITE_MAGIC = b"SQLite format 3\x00"

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


def check(path: Path, conn: sqlite3.Connection) -> bool:
    """Refuse anything that is not a healthy outbox; True when the file is an empty SQLite database."""
    with open(path, "rb") as fh:
        head = fh.read(len(SQLITE_MAGIC))
    if head and head != SQLITE_MAGIC:
        raise corrupt(path, "is not a SQLite database")
    try:
        problems = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise corrupt(path, f"failed SQLite's integrity check ({'; '.join(problems[:3])})")
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return True
        if not {"messages", "meta"} <= tables:
            raise corrupt(path, f"is a SQLite database but not a reliable-kafka outbox (tables: {sorted(tables)})")
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    except sqlite3.Error as exc:
        if is_damage(exc):
            raise corrupt(path, f"is damaged ({exc})") from exc
        raise read_error(path, exc) from exc
    if meta.get("format") != FORMAT_MARKER:
        raise corrupt(path, "has outbox-like tables but no reliable-kafka outbox marker in its meta table")
    version = meta.get("schema_version")
    if version not in _READABLE_VERSIONS:
        raise OutboxError(
            f"outbox {path} has schema version {version}, this reliable-kafka reads version "
            f"{SCHEMA_VERSION}; use the reliable-kafka version that wrote it"
        )
    return False


def create(path: Path, db: sqlite_utils.Database) -> None:
    """Create the tables and the marker in an empty database."""
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
    log.info("created outbox %s", path)


def has_batches_table(conn: sqlite3.Connection) -> bool:
    """False for a version 1 file (opened read-only, so never upgraded)."""
    found = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'batches'").fetchone()
    return found is not None


def upgrade(path: Path, conn: sqlite3.Connection) -> None:
    """Schema version 1 -> 2: add the (empty) batches table; the messages table is unchanged."""
    if has_batches_table(conn):
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(_BATCHES_DDL)
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    log.info("outbox %s upgraded to schema version %d", path, SCHEMA_VERSION)
