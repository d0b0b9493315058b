"""Dead-letter records: where a poison record is parked (DeadLetterPolicy) and headers saying why.

Guarantee: the original headers (rk-id included) come first and unchanged, followed by one complete block
of rk-dlq-* headers (origin, error, attempts); the last block always describes the latest failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reliable_kafka.errors import ConfigError
from reliable_kafka.ids import (
    DLQ_ATTEMPTS,
    DLQ_ERROR,
    DLQ_ERROR_TYPE,
    DLQ_OFFSET,
    DLQ_PARTITION,
    DLQ_TIMESTAMP,
    DLQ_TOPIC,
    message_id_of,
)

DEFAULT_DLQ_TEMPLATE = "{topic}.dlq"

# Kafka itself accepts headers of any size, but a 10 MB stack dump would push the dead-letter record
# past message.max.bytes and make the DLQ write fail: the one write that must not.
MAX_ERROR_BYTES = 4096

_DLQ_HEADERS = (DLQ_TOPIC, DLQ_PARTITION, DLQ_OFFSET, DLQ_TIMESTAMP, DLQ_ERROR_TYPE, DLQ_ERROR, DLQ_ATTEMPTS)
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")  # the broker's own rule for topic names

# The shapes confluent-kafka uses: Message.headers() gives them, Producer.produce(headers=...) takes them.
HeaderValue = str | bytes | None
Headers = list[tuple[str, HeaderValue]]


@dataclass(frozen=True)
class DeadLetterPolicy:
    """Where poison records go. `template` may use {topic}; `timeout_s` bounds one DLQ write, and a write
    that failed is tried again every `retry_every_s` while its partition waits."""

    template: str = DEFAULT_DLQ_TEMPLATE
    producer_config: Mapping[str, Any] | None = None
    timeout_s: float = 30.0
    retry_every_s: float = 5.0


def dlq_topic_for(topic: str, template: str = DEFAULT_DLQ_TEMPLATE) -> str:
    """The dead-letter topic of `topic`: `template` with {topic} replaced (a fixed name is fine too).

    Raises ConfigError when the result is not a legal Kafka topic name, or is the source topic itself
    (poison would be fed straight back to the consumer that just gave up on it).
    """
    try:
        name = template.format(topic=topic)
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(
            "dlq_topic", f"template {template!r} must only use the {{topic}} placeholder ({exc!r})"
        ) from None
    if not _LEGAL_TOPIC.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            "dlq_topic",
            f"{name!r} (from template {template!r}) is not a legal Kafka topic name: "
            "use 1-249 characters from a-z A-Z 0-9 . _ -",
        )
    if name == topic:
        raise ConfigError("dlq_topic", f"template {template!r} names the source topic {topic!r} itself")
    return name


def _type_name(error: BaseException) -> str:
    kind = type(error)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _message(error: BaseException, limit: int) -> bytes:
    """str(error) as UTF-8, cut to at most `limit` bytes on a character boundary."""
    try:
        text = str(error) or repr(error)
    except Exception:  # a broken __str__ must not stop the record from being parked
        text = f"<unprintable {type(error).__name__}>"
    encoded = text.encode("utf-8", "backslashreplace")
    if len(encoded) <= limit:
        return encoded
    marker = f"... [truncated, {len(encoded)} bytes]".encode()
    kept = encoded[: max(0, limit - len(marker))].decode("utf-8", "ignore").encode()
    return (kept + marker)[:limit]


def dead_letter_headers(
    *,
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int | None,
    error: BaseException,
    attempts: int,
    original_headers: Sequence[tuple[str, HeaderValue]] | Mapping[str, HeaderValue] | None,
    max_error_bytes: int = MAX_ERROR_BYTES,
) -> Headers:
    """Headers for the dead-letter copy of a record: its own headers, then where it came from and why.

    `error` is the handler's own exception (RetriesExhausted.last_error), `attempts` how many calls
    were made, `timestamp_ms` the record's timestamp (None when the broker gave none). The error text
    is cut to `max_error_bytes`. Original header values are passed on as they are (None stays None).
    """
    headers: Headers
    if isinstance(original_headers, Mapping):
        headers = list(original_headers.items())
    else:
        headers = list(original_headers or ())
    headers += [
        (DLQ_TOPIC, topic.encode()),
        (DLQ_PARTITION, str(partition).encode()),
        (DLQ_OFFSET, str(offset).encode()),
        # Always present (empty when unknown) so the rk-dlq-* block is complete on every record.
        (DLQ_TIMESTAMP, b"" if timestamp_ms is None else str(timestamp_ms).encode()),
        (DLQ_ERROR_TYPE, _type_name(error).encode()),
        (DLQ_ERROR, _message(error, max_error_bytes)),
        (DLQ_ATTEMPTS, str(attempts).encode()),
    ]
    return headers


@dataclass(frozen=True)
class DeadLetterInfo:
    """What a dead-letter record says about its origin and its failure."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int | None
    error_type: str
    error: str
    attempts: int
    message_id: str | None  # the original rk-id, or None if a foreign producer wrote the record
    original_headers: list[tuple[str, bytes | None]]  # as the record carried them, without this block


def parse_dead_letter_headers(headers: Sequence[tuple[str, HeaderValue]] | None) -> DeadLetterInfo:
    """Read the headers written by dead_letter_headers() (the latest block when a record was parked twice).

    Raises ValueError when a rk-dlq-* header is missing or malformed: the record is not a dead letter.
    """
    # Consumed header values are bytes; str only appears in headers built locally for produce().
    items = [(key, value.encode() if isinstance(value, str) else value) for key, value in headers or ()]
    last: dict[str, int] = {}
    for index, (key, _) in enumerate(items):
        if key in _DLQ_HEADERS:
            last[key] = index
    values: dict[str, str] = {}
    for key in _DLQ_HEADERS:
        if key not in last or items[last[key]][1] is None:
            raise ValueError(f"not a dead-letter record: header {key!r} is missing")
        values[key] = (items[last[key]][1] or b"").decode("utf-8", "replace")

    def number(key: str) -> int:
        try:
            return int(values[key])
        except ValueError:
            raise ValueError(f"dead-letter header {key!r} is not an integer: {values[key]!r}") from None

    ours = set(last.values())
    original = [item for index, item in enumerate(items) if index not in ours]
    return DeadLetterInfo(
        topic=values[DLQ_TOPIC],
        partition=number(DLQ_PARTITION),
        offset=number(DLQ_OFFSET),
        timestamp_ms=number(DLQ_TIMESTAMP) if values[DLQ_TIMESTAMP] else None,
        error_type=values[DLQ_ERROR_TYPE],
        error=values[DLQ_ERROR],
        attempts=number(DLQ_ATTEMPTS),
        message_id=message_id_of(original),
        original_headers=original,
    )
