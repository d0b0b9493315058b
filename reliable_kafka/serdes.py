"""Serializers and deserializers: a user's plain function or confluent-kafka Serializer object, made one call.

Guarantee: what a client's encode step returns is bytes or None, and what goes wrong in a user's
(de)serializer reaches the caller as SerializationError / DeserializationError, the original chained,
naming the topic and the field. The shape is decided once, when the client is built, never per record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from confluent_kafka.serialization import Deserializer, MessageField, SerializationContext, Serializer

from reliable_kafka.errors import DeserializationError, SerializationError

Field = Literal["key", "value"]
# (topic, headers) travel with each call: a Schema Registry serializer picks its subject by topic and may
# read (deserializer) or add (serializer, header schema ids) headers: pass the list that is sent.
HeaderList = list[tuple[str, "str | bytes | None"]] | dict[str, "str | bytes | None"]
Encode = Callable[[str, Any, "HeaderList | None"], "bytes | None"]
Decode = Callable[[str, "bytes | None", "HeaderList | None"], Any]

# A user's serializer: `f(obj) -> bytes`, or a confluent-kafka Serializer called as s(obj, ctx).
UserSerializer = Callable[[Any], bytes] | Serializer
# A user's deserializer: `f(data) -> obj`, or a confluent-kafka Deserializer called as d(data, ctx).
UserDeserializer = Callable[[bytes], Any] | Deserializer

_FIELDS = {"key": MessageField.KEY, "value": MessageField.VALUE}


def encoder(serializer: UserSerializer | None, field: Field) -> Encode:
    """The one call that turns a key or value into bytes for `topic`: encode(topic, obj, headers).

    None stays None (a tombstone, or no key). Without a serializer only bytes-like objects are taken.
    A confluent-kafka Serializer (Schema Registry's AvroSerializer, JSONSerializer, ProtobufSerializer, ...)
    is called with SerializationContext(topic, field, headers); a plain function with the object alone.
    """
    if serializer is None:
        return _no_serializer(field)
    if isinstance(serializer, Serializer):
        ctx_field = _FIELDS[field]

        def encode(topic: str, obj: Any, headers: HeaderList | None) -> bytes | None:
            if obj is None:
                return None
            try:
                out = serializer(obj, SerializationContext(topic, ctx_field, headers))
            except Exception as exc:
                raise _serialize_failed(field, topic, obj, exc) from exc
            return out if type(out) is bytes else _bytes_or_none(field, topic, out)
    else:
        f: Callable[[Any], bytes] = serializer

        def encode(topic: str, obj: Any, headers: HeaderList | None) -> bytes | None:
            if obj is None:
                return None
            try:
                out = f(obj)
            except Exception as exc:
                raise _serialize_failed(field, topic, obj, exc) from exc
            return out if type(out) is bytes else _bytes_or_none(field, topic, out)

    return encode


def decoder(deserializer: UserDeserializer | None, field: Field) -> Decode | None:
    """The one call that turns a record's key or value bytes into an object: decode(topic, data, headers).

    None without a deserializer: the caller then skips decoding altogether (no per-record cost).
    A confluent-kafka Deserializer is called with SerializationContext(topic, field, headers), and with
    None too, as confluent's own consumer does; a plain function never sees None (it stays None).
    """
    if deserializer is None:
        return None
    if isinstance(deserializer, Deserializer):
        ctx_field = _FIELDS[field]

        def decode(topic: str, data: bytes | None, headers: HeaderList | None) -> Any:
            try:
                return deserializer(data, SerializationContext(topic, ctx_field, headers))
            except Exception as exc:
                raise _deserialize_failed(field, topic, exc) from exc
    else:
        f: Callable[[bytes], Any] = deserializer

        def decode(topic: str, data: bytes | None, headers: HeaderList | None) -> Any:
            if data is None:
                return None
            try:
                return f(data)
            except Exception as exc:
                raise _deserialize_failed(field, topic, exc) from exc

    return decode


def _no_serializer(field: Field) -> Encode:
    def encode(topic: str, obj: Any, headers: HeaderList | None) -> bytes | None:
        if obj is None or type(obj) is bytes:
            return obj
        if isinstance(obj, (bytes, bytearray, memoryview)):
            return bytes(obj)
        raise SerializationError(
            f"the {field} for topic {topic!r} is a {type(obj).__name__}, not bytes; encode it first or pass "
            f"{field}_serializer=", topic=topic)

    return encode


def _bytes_or_none(field: Field, topic: str, out: object) -> bytes | None:
    if out is None:
        return None
    if isinstance(out, (bytes, bytearray, memoryview)):
        return bytes(out)
    raise SerializationError(f"the {field} serializer returned {type(out).__name__} for topic {topic!r}, not "
                             f"bytes; make {field}_serializer return bytes", topic=topic)


def _serialize_failed(field: Field, topic: str, obj: object, exc: Exception) -> SerializationError:
    if isinstance(exc, SerializationError):
        return exc  # ours already (a serializer built on this module): it names what happened
    return SerializationError(
        f"the {field} serializer failed on a {type(obj).__name__} for topic {topic!r}: {exc!r}; fix the "
        f"{field} (or {field}_serializer, or the schema it is registered with) and send it again", topic=topic)


def _deserialize_failed(field: Field, topic: str, exc: Exception) -> DeserializationError:
    if isinstance(exc, DeserializationError):
        return exc
    return DeserializationError(
        f"the {field} deserializer failed on a record of topic {topic!r}: {exc!r}; the record is poison for "
        f"this {field}_deserializer (it is retried, then dead-lettered with its original bytes): fix the "
        f"producer that wrote it, or the deserializer", field=field, topic=topic)
