"""The `messages` table's rows: encoding NewMessages into them, decoding them into OutboxRows, and the
SQL shared by the Outbox's operations on that table.

Stateless: every function works inside the caller's transaction and lock; a message that cannot be
encoded raises SerializationError before anything is written.
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from reliable_kafka.errors import SerializationError
from reliable_kafka.spool import NewMessage, OutboxRow

PENDING = "pending"
FAILED = "failed"
STATES = (PENDING, FAILED)

# SQLite limits bound parameters per statement (999 before 3.32); IN-lists are chunked below that.
_IN_CHUNK = 900

# Payload size of a row as SQLite sees it; must agree with payload_size() below.
SIZE_SQL = "coalesce(length(key), 0) + coalesce(length(value), 0) + coalesce(length(headers), 0)"
COLUMNS = "seq, message_id, topic, key, value, headers, partition, state, attempts, last_error, created_ms"
INSERT_SQL = (
    "INSERT INTO messages (message_id, topic, key, value, headers, partition, created_ms) "
    "VALUES (?, ?, ?, ?, ?, ?, ?)"
)

# A journaled message keeps the seq it was accepted with when it is settled into the table.
INSERT_WITH_SEQ_SQL = (
    "INSERT INTO messages (seq, message_id, topic, key, value, headers, partition, created_ms) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)

_HEADER = struct.Struct(">HI")


def encode_headers(headers: Sequence[tuple[str, bytes]]) -> bytes | None:
    """The compact blob stored in `messages.headers` (layout in schema.py); None for no headers."""
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


def rows_of(messages: Sequence[NewMessage], now_ms: int) -> tuple[list[tuple[Any, ...]], int]:
    """The `messages` rows of a batch (parameters of INSERT_SQL) and their payload bytes."""
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


def row_of(raw: Any) -> OutboxRow:
    """The OutboxRow of a row selected as COLUMNS."""
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


def chunks(values: Sequence[Any], size: int = _IN_CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def placeholders(n: int) -> str:
    return ",".join("?" * n)


def selection(state: str, seqs: Iterable[int] | None) -> Iterator[tuple[str, Sequence[object]]]:
    """WHERE clauses (with parameters) for rows in `state`, optionally restricted to `seqs`."""
    if seqs is None:
        yield "state = ?", (state,)
        return
    for chunk in chunks(list(seqs)):
        yield f"state = ? AND seq IN ({placeholders(len(chunk))})", (state, *chunk)


def delete_rows(conn: sqlite3.Connection, where: str, params: Sequence[object], *,
                count_bytes: bool) -> tuple[int, int]:
    """Delete the rows matching `where`: (rows deleted, their payload bytes when `count_bytes`)."""
    freed = 0
    if count_bytes:  # byte accounting costs one read of the rows about to go
        freed = conn.execute(f"SELECT coalesce(sum({SIZE_SQL}), 0) FROM messages WHERE {where}", params).fetchone()[0]
    return conn.execute(f"DELETE FROM messages WHERE {where}", params).rowcount, freed


def count_rows(conn: sqlite3.Connection) -> tuple[int, int, int]:
    """(pending rows, failed rows, payload bytes of both) of the `messages` table, counted afresh."""
    pending = failed = total_bytes = 0
    for state, count, size in conn.execute(
        f"SELECT state, count(*), coalesce(sum({SIZE_SQL}), 0) FROM messages GROUP BY state"
    ):
        if state == PENDING:
            pending += count
        elif state == FAILED:
            failed = count
        total_bytes += size
    return pending, failed, total_bytes
