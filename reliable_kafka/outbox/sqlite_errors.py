"""SQLite failures translated into the outbox's errors: corrupt, read-only, full disk, I/O error.

Every error names the outbox file and says what to do; a damaged file is OutboxCorrupt and is left
exactly as it is, any other failure is an OutboxError after which nothing half-written remains.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from reliable_kafka.errors import OutboxCorrupt, OutboxError

# Primary SQLite result codes we explain to the user (the extended code's low byte is the primary one).
SQLITE_READONLY = 8
SQLITE_IOERR = 10
SQLITE_CORRUPT = 11
SQLITE_FULL = 13
SQLITE_CANTOPEN = 14
SQLITE_NOTADB = 26


def primary_code(exc: sqlite3.Error) -> int | None:
    """The primary SQLite result code of `exc`, or None when it carries none we know."""
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is not None:
        return int(code) & 0xFF
    text = str(exc).lower()  # Python 3.10: classify by SQLite's fixed message texts
    for needle, primary in (
        ("disk is full", SQLITE_FULL),
        ("readonly", SQLITE_READONLY),
        ("disk i/o error", SQLITE_IOERR),
        ("malformed", SQLITE_CORRUPT),
        ("not a database", SQLITE_NOTADB),
        ("unable to open", SQLITE_CANTOPEN),
    ):
        if needle in text:
            return primary
    return None


def is_damage(exc: sqlite3.Error) -> bool:
    """True when SQLite says the file itself is damaged (not the disk, not permissions)."""
    return primary_code(exc) in (SQLITE_CORRUPT, SQLITE_NOTADB)


def corrupt(path: Path, why: str) -> OutboxCorrupt:
    return OutboxCorrupt(
        f"{path} {why}; the file was left exactly as it is. Move it aside (keep it: it may hold "
        "undelivered messages) and start again with a fresh outbox path, or point at the right file"
    )


def read_error(path: Path, exc: sqlite3.Error) -> OutboxError:
    return OutboxError(f"cannot read outbox {path}: {exc}")


def write_error(path: Path, what: str, exc: sqlite3.Error) -> OutboxError:
    """The error for a write (`what`) that SQLite refused and that was rolled back."""
    code = primary_code(exc)
    if code == SQLITE_FULL:
        advice = f"the disk holding {path.parent} is full; free space there or move the outbox"
    elif code in (SQLITE_READONLY, SQLITE_CANTOPEN):
        advice = f"{path} or its directory is read-only; fix permissions or choose a writable path"
    elif code == SQLITE_IOERR:
        advice = f"the disk under {path} reported an I/O error; check the device and its filesystem"
    elif code in (SQLITE_CORRUPT, SQLITE_NOTADB):
        return corrupt(path, f"turned out damaged during {what} ({exc})")
    else:
        advice = "see the SQLite error above"
    return OutboxError(
        f"outbox {path}: {what} failed and was rolled back, nothing was written ({exc}); {advice}"
    )
