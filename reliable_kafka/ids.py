"""Message ids and the header names reliable_kafka writes.

Every message gets a time-ordered unique id (UUIDv7 layout) in the `rk-id` header, so a re-send
after a crash carries the same id as its original and downstream dedup can recognise it.
"""

from __future__ import annotations

import os
import threading
import time

ID_HEADER = "rk-id"

# Dead-letter headers: where the poison record came from and why it was parked.
DLQ_TOPIC = "rk-dlq-topic"
DLQ_PARTITION = "rk-dlq-partition"
DLQ_OFFSET = "rk-dlq-offset"
DLQ_TIMESTAMP = "rk-dlq-timestamp"
DLQ_ERROR_TYPE = "rk-dlq-error-type"
DLQ_ERROR = "rk-dlq-error"
DLQ_ATTEMPTS = "rk-dlq-attempts"

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def new_id() -> str:
    """A UUIDv7-formatted id: 48-bit unix milliseconds, a 12-bit in-millisecond counter, 62 random bits.

    The counter keeps ids from one process strictly increasing even within a millisecond, so the
    outbox order and the id order agree.
    """
    global _last_ms, _counter
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            _counter += 1
            if _counter > 0xFFF:  # counter overflow: borrow the next millisecond
                _last_ms += 1
                _counter = 0
            ms = _last_ms
        else:
            _last_ms = ms
            _counter = 0
        counter = _counter
    rand = int.from_bytes(os.urandom(8), "big") & 0x3FFF_FFFF_FFFF_FFFF
    value = (ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | rand
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def id_timestamp_ms(message_id: str) -> int:
    """The unix time in milliseconds at which an id was made."""
    return int(message_id.replace("-", "")[:12], 16)


def header_value(headers: list[tuple[str, bytes | None]] | dict[str, bytes] | None, name: str) -> bytes | None:
    """The last value of header `name`, from the list or dict confluent-kafka gives."""
    if not headers:
        return None
    if isinstance(headers, dict):
        return headers.get(name)
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return found


def message_id_of(headers: list[tuple[str, bytes | None]] | dict[str, bytes] | None) -> str | None:
    """The rk-id of a consumed message, or None if a foreign producer wrote it."""
    raw = header_value(headers, ID_HEADER)
    return raw.decode() if raw is not None else None
