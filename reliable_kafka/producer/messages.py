"""What send() and send_many() take and return, and how one input becomes a row for the spool.

A message is refused here (ConfigError, SerializationError) before anything of its batch is stored;
serializers are called in this one place (`Preparer.prepare`, through reliable_kafka.serdes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from reliable_kafka.errors import ConfigError, SerializationError
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.producer.send_spans import SendSpans
from reliable_kafka.serdes import UserSerializer, encoder
from reliable_kafka.spool import NewMessage

Headers = Mapping[str, str | bytes] | Sequence[tuple[str, str | bytes]] | None
# What value_serializer= / key_serializer= take: a function or a confluent-kafka Serializer (serdes.py).
Serializer = UserSerializer


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


def _headers(headers: Headers | list[tuple[str, Any]]) -> list[tuple[str, bytes]]:
    if not headers:
        return []
    items = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    for k, v in items:
        if not isinstance(k, str):
            raise SerializationError(f"header names must be str, got {type(k).__name__}")
        out.append((k, v if type(v) is bytes else v.encode() if isinstance(v, str) else b"" if v is None
                    else bytes(v)))
    return out


class Preparer:
    """Turns a Message (or a tuple that is not a plain (topic, bytes) pair) into a NewMessage."""

    def __init__(self, value_serializer: UserSerializer | None, key_serializer: UserSerializer | None,
                 *, spans: SendSpans | None) -> None:
        # One call each, its shape (function, confluent Serializer, none) decided here, not per message.
        self._encode_value = encoder(value_serializer, "value")
        self._encode_key = encoder(key_serializer, "key")
        self._spans = spans  # None unless the producer traces

    def prepare(self, m: Message | tuple[str, Any], fresh_id: str) -> NewMessage:
        """Validate and serialize one message. The rk-id is kept as message_id, not as a stored header:
        it is added when the message is handed to librdkafka."""
        if not isinstance(m, Message):
            m = Message(*m)
        if not isinstance(m.topic, str) or not m.topic:
            raise ConfigError("topic", f"must be a non-empty str, got {m.topic!r}")
        # The headers first: a confluent serializer gets this list in its SerializationContext and may
        # add to it (a schema id header, say), and what is sent is the list it saw.
        headers = _headers(m.headers)
        given = len(headers)
        # The key first, as confluent's SerializingProducer does; bytes skip the serializer (no call).
        # (The ignores: a list of (str, bytes) is a HeaderList, but list is invariant; cast() would cost a call.)
        key = (m.key if m.key is None or type(m.key) is bytes
               else self._encode_key(m.topic, m.key, headers))  # type: ignore[arg-type]
        value = (m.value if type(m.value) is bytes
                 else self._encode_value(m.topic, m.value, headers))  # type: ignore[arg-type]
        if len(headers) != given:
            headers = _headers(headers)  # what a serializer added: made (str, bytes) like the rest
        message_id = m.message_id
        if message_id is None:
            # A caller-supplied rk-id header is the caller's idempotency key: keep it.
            message_id = next((v.decode() for k, v in reversed(headers) if k == ID_HEADER), fresh_id)
        user_headers = [h for h in headers if h[0] != ID_HEADER]
        if self._spans is not None:
            # Its context goes into the stored headers: a re-send after a restart stays in the trace.
            self._spans.start(m.topic, message_id, key, user_headers)
        return NewMessage(message_id, m.topic, value, key, tuple(user_headers), m.partition)
