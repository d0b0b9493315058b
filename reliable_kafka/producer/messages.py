"""What send() and send_many() take and return, and how one input becomes a row for the spool.

A message is refused here (ConfigError, SerializationError) before anything of its batch is stored;
serializers are called in this one place (`_to_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from reliable_kafka import telemetry
from reliable_kafka.errors import ConfigError, SerializationError
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.spool import NewMessage

Headers = Mapping[str, str | bytes] | Sequence[tuple[str, str | bytes]] | None
Serializer = Callable[[Any], bytes]


class Sent(NamedTuple):
    """What send() returns: the message is durable (per the durability mode) and has this id.

    A NamedTuple for the same reason as NewMessage: send_many() returns one per message.
    """

    message_id: str
    seq: int
    error: str | None = None  # set when Kafka refused it at once; it is then kept in the outbox as failed


@dataclass(frozen=True)
class Message:
    """One message for send_many()."""

    topic: str
    value: Any
    key: Any = None
    headers: Headers = None
    partition: int | None = None
    message_id: str | None = None


new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (hot paths only)


def plain_rows(batch: Sequence[Any], ids: Sequence[str]) -> list[NewMessage] | None:
    """NewMessages for a batch made only of (topic, bytes) pairs — the hot path — else None."""
    try:
        rows = [new_tuple(NewMessage, (i, t, v, None, (), None))
                for (t, v), i in zip(batch, ids, strict=True) if type(t) is str and t and type(v) is bytes]
    except (TypeError, ValueError):  # a Message, or a tuple of another length
        return None
    return rows if len(rows) == len(batch) else None


def _to_bytes(what: str, value: Any, serializer: Serializer | None) -> bytes | None:
    if value is None:
        return None
    if serializer is not None:
        out = serializer(value)
        if not isinstance(out, (bytes, bytearray)):
            raise SerializationError(f"the {what} serializer returned {type(out).__name__}, not bytes")
        return bytes(out)
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise SerializationError(
        f"the {what} is a {type(value).__name__}, not bytes; encode it first or pass {what}_serializer="
    )


def _headers(headers: Headers) -> list[tuple[str, bytes]]:
    if not headers:
        return []
    items = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    for k, v in items:
        if not isinstance(k, str):
            raise SerializationError(f"header names must be str, got {type(k).__name__}")
        out.append((k, v.encode() if isinstance(v, str) else b"" if v is None else bytes(v)))
    return out


class Preparer:
    """Turns a Message (or a tuple that is not a plain (topic, bytes) pair) into a NewMessage."""

    def __init__(self, value_serializer: Serializer | None, key_serializer: Serializer | None,
                 *, tracing: bool) -> None:
        self._value_serializer = value_serializer
        self._key_serializer = key_serializer
        self._tracing = tracing

    def prepare(self, m: Message | tuple[str, Any], fresh_id: str) -> NewMessage:
        """Validate and serialize one message. The rk-id is kept as message_id, not as a stored header:
        it is added when the message is handed to librdkafka."""
        if not isinstance(m, Message):
            m = Message(*m)
        if not isinstance(m.topic, str) or not m.topic:
            raise ConfigError("topic", f"must be a non-empty str, got {m.topic!r}")
        value = m.value if type(m.value) is bytes else _to_bytes("value", m.value, self._value_serializer)
        key = m.key if m.key is None or type(m.key) is bytes else _to_bytes("key", m.key, self._key_serializer)
        headers = _headers(m.headers)
        message_id = m.message_id
        if message_id is None:
            # A caller-supplied rk-id header is the caller's idempotency key: keep it.
            message_id = next((v.decode() for k, v in reversed(headers) if k == ID_HEADER), fresh_id)
        user_headers = [h for h in headers if h[0] != ID_HEADER]
        if self._tracing:
            telemetry.publish_span(m.topic, message_id, user_headers)
        return NewMessage(message_id, m.topic, value, key, tuple(user_headers), m.partition)
