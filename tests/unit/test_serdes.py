"""Serializers: a plain function or a confluent-kafka Serializer object (Schema Registry's Avro / JSON Schema
serializers against confluent's own mock:// registry) becomes one call with the SerializationContext, and what
goes wrong in it becomes SerializationError / DeserializationError, chained, naming topic and field. Then the
consumer's decode stage: the handler sees decoded records, and a record that cannot be decoded is poison that
reaches the dead-letter stage with its original bytes. No broker.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka import Message
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import (
    Deserializer,
    MessageField,
    SerializationContext,
    Serializer,
    StringDeserializer,
)
from confluent_kafka.serialization import SerializationError as ConfluentSerializationError

from reliable_kafka import (
    DeadLetterPolicy,
    DeserializationError,
    InputRefused,
    RetryPolicy,
    SerializationError,
)
from reliable_kafka.consumer.decoding import Decoding
from reliable_kafka.consumer.failures import DeadLetters
from reliable_kafka.consumer.strategies import choose
from reliable_kafka.consumer.work import Work
from reliable_kafka.serdes import decoder, encoder
from tests.fixtures.consumer_parts import Parts, T, batch, parts

ORDER_AVRO = json.dumps({"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "int"}, {"name": "item", "type": "string"}]})
ORDER_JSON = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})


@pytest.fixture
def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": "mock://serdes-test"})


# ---- serializers ------------------------------------------------------------------------------------


def test_a_plain_function_is_still_taken_and_none_stays_none() -> None:
    calls: list[Any] = []
    encode = encoder(lambda v: calls.append(v) or json.dumps(v).encode(), "value")
    assert encode(T, {"a": 1}, None) == b'{"a": 1}'
    assert encode(T, None, None) is None, "a tombstone is not serialized"
    assert calls == [{"a": 1}]
    assert encoder(lambda v: bytearray(v.encode()), "key")(T, "k", None) == b"k"


def test_without_a_serializer_only_bytes_are_taken() -> None:
    encode = encoder(None, "value")
    assert encode(T, b"v", None) == b"v" and encode(T, bytearray(b"w"), None) == b"w" and encode(T, None, None) is None
    with pytest.raises(SerializationError, match=r"value for topic .orders. is a str, not bytes.*value_serializer="):
        encode(T, "text", None)


def test_a_serializers_own_exception_becomes_serialization_error_chained() -> None:
    boom = ValueError("no such order")

    def bad(v: object) -> bytes:
        raise boom

    with pytest.raises(SerializationError) as caught:
        encoder(bad, "key")(T, {"id": 1}, None)
    assert caught.value.__cause__ is boom and caught.value.topic == T
    assert "key serializer failed on a dict for topic 'orders'" in str(caught.value)
    assert "fix the key (or key_serializer" in str(caught.value)
    assert isinstance(caught.value, (InputRefused, TypeError))


def test_a_serializer_that_returns_no_bytes_is_refused() -> None:
    with pytest.raises(SerializationError, match=r"value serializer returned str for topic 'orders', not bytes"):
        encoder(lambda v: "text", "value")(T, 1, None)  # type: ignore[arg-type,return-value]


def test_a_confluent_serializer_gets_the_context_topic_field_and_headers() -> None:
    seen: list[tuple[str, MessageField, Any]] = []

    class Recording(Serializer):
        def __call__(self, obj: Any, ctx: SerializationContext | None = None) -> bytes | None:
            assert ctx is not None
            seen.append((ctx.topic, ctx.field, ctx.headers))
            if isinstance(ctx.headers, list):
                ctx.headers.append(("schema", b"7"))  # as a header schema-id serializer does
            return str(obj).encode()

    headers: list[tuple[str, str | bytes | None]] = [("h", b"1")]
    assert encoder(Recording(), "key")(T, 5, headers) == b"5"
    assert encoder(Recording(), "value")("payments", 6, None) == b"6"
    assert seen == [(T, MessageField.KEY, headers), ("payments", MessageField.VALUE, None)]
    assert headers == [("h", b"1"), ("schema", b"7")], "the serializer's headers are the ones sent"


def test_schema_registry_avro_round_trip_under_the_topics_subject(registry: SchemaRegistryClient) -> None:
    encode = encoder(AvroSerializer(registry, ORDER_AVRO), "value")
    data = encode(T, {"id": 1, "item": "book"}, None)
    assert isinstance(data, bytes) and data[0] == 0, "Confluent framing: magic byte, then the schema id"
    assert registry.get_subjects() == ["orders-value"], "the context named the topic and the field"
    decode = decoder(AvroDeserializer(registry), "value")
    assert decode is not None and decode(T, data, None) == {"id": 1, "item": "book"}


def test_schema_registry_errors_become_ours_with_the_original_chained(registry: SchemaRegistryClient) -> None:
    with pytest.raises(SerializationError, match="value serializer failed on a dict for topic 'orders'") as caught:
        encoder(JSONSerializer(ORDER_JSON, registry), "value")(T, {"id": "not a number"}, None)
    assert isinstance(caught.value.__cause__, ConfluentSerializationError)
    with pytest.raises(SerializationError) as avro:
        encoder(AvroSerializer(registry, ORDER_AVRO), "value")(T, {"id": "x"}, None)
    assert avro.value.__cause__ is not None


# ---- deserializers ----------------------------------------------------------------------------------


def test_no_deserializer_means_no_decode_step() -> None:
    assert decoder(None, "value") is None and decoder(None, "key") is None


def test_schema_registry_json_round_trip(registry: SchemaRegistryClient) -> None:
    data = encoder(JSONSerializer(ORDER_JSON, registry), "value")(T, {"id": 2}, None)
    decode = decoder(JSONDeserializer(ORDER_JSON, schema_registry_client=registry), "value")
    assert decode is not None and decode(T, data, None) == {"id": 2}


def test_undecodable_bytes_become_deserialization_error_chained(registry: SchemaRegistryClient) -> None:
    decode = decoder(AvroDeserializer(registry), "value")
    assert decode is not None
    with pytest.raises(DeserializationError) as caught:
        decode(T, b"not avro at all", None)
    exc = caught.value
    assert isinstance(exc.__cause__, ConfluentSerializationError)
    assert (exc.field, exc.topic) == ("value", T) and isinstance(exc, (InputRefused, ValueError))
    assert "value deserializer failed on a record of topic 'orders'" in str(exc)


def test_a_confluent_deserializer_gets_none_a_plain_function_never_does() -> None:
    calls: list[Any] = []

    class Recording(Deserializer):
        def __call__(self, value: bytes | None, ctx: SerializationContext | None = None) -> Any:
            assert ctx is not None
            calls.append((value, ctx.topic, ctx.field))
            return value

    confluent, plain = decoder(Recording(), "key"), decoder(lambda b: calls.append(b), "value")
    assert confluent is not None and plain is not None
    confluent(T, None, None)
    assert plain(T, None, None) is None
    assert calls == [(None, T, MessageField.KEY)]


# ---- the consumer's decode stage ----------------------------------------------------------------------


def _decoding(registry: SchemaRegistryClient) -> Decoding:
    return Decoding(decoder(StringDeserializer(), "key"), decoder(AvroDeserializer(registry), "value"))


def _records(registry: SchemaRegistryClient, *offsets: int, bad: int | None = None) -> list[Message]:
    encode = encoder(AvroSerializer(registry, ORDER_AVRO), "value")
    msgs = batch(*((0, o) for o in offsets))
    for m in msgs:
        o = m.offset()
        m.set_key(f"k{o}".encode())
        m.set_value(b"\x00garbage" if o == bad else encode(T, {"id": o, "item": "i"}, None))
    return msgs


class RecordingDeadLetters(DeadLetters):
    """The dead-letter stage with the write recorded instead of sent (no broker)."""

    def __init__(self) -> None:
        super().__init__(DeadLetterPolicy(), {})
        self.written: list[tuple[int | None, bytes | None, bytes | None, BaseException]] = []

    def write(self, w: Work, error: BaseException, attempts: int) -> None:
        self.written.append((w.msg.offset(), w.msg.key(), w.msg.value(), error))  # type: ignore[arg-type]


def _strategy(p: Parts, handler: Any, *, batch_: bool = False) -> Any:
    return choose(handler, batch=batch_, concurrency=1, tracing=False, dedup=None, single_topic=T,
                  fetcher=p.fetcher, failures=p.failures, commits=p.commits, counters=p.counters)


def test_the_handler_sees_decoded_records_and_all_are_committed(registry: SchemaRegistryClient) -> None:
    p = parts()
    seen: list[tuple[Any, Any]] = []
    _strategy(p, _decoding(registry).handler(lambda m: seen.append((m.key(), m.value())))).handle_fetched(
        _records(registry, 0, 1, 2))
    assert seen == [(f"k{o}", {"id": o, "item": "i"}) for o in range(3)]
    assert p.commits.committable() == {(T, 0): 3}


@pytest.mark.parametrize("batch_", [False, True])
def test_an_undecodable_record_is_retried_then_dead_lettered_with_its_original_bytes(
        registry: SchemaRegistryClient, batch_: bool) -> None:
    p = parts(retry=RetryPolicy(attempts=2, initial_backoff_s=0.001, max_backoff_s=0.001))
    dlq = RecordingDeadLetters()
    p.failures.dead_letters = dlq
    seen: list[int] = []
    decoding = _decoding(registry)
    if batch_:
        handler = decoding.batch_handler(lambda ms: seen.extend(m.value()["id"] for m in ms))
    else:
        handler = decoding.handler(lambda m: seen.append(m.value()["id"]))
    msgs = _records(registry, 0, 1, 2, bad=1)
    _strategy(p, handler, batch_=batch_).handle_fetched(msgs)
    assert sorted(set(seen)) == [0, 2], "every decodable record was handled"
    [(offset, key, value, error)] = dlq.written
    assert (offset, key, value) == (1, b"k1", b"\x00garbage"), "the DLQ gets the record as consumed"
    assert isinstance(error, DeserializationError) and error.partition == 0
    assert p.counters.get("dead_lettered") == 1
    assert p.commits.committable() == {(T, 0): 3}, "none lost, none held: the poison is parked, the rest done"


def test_a_failing_handler_leaves_the_record_as_consumed_for_its_retry_and_the_dlq(
        registry: SchemaRegistryClient) -> None:
    p = parts(retry=RetryPolicy(attempts=3, initial_backoff_s=0.001, max_backoff_s=0.001))
    dlq = RecordingDeadLetters()
    p.failures.dead_letters = dlq
    attempts: list[Any] = []

    def handler(m: Message) -> None:
        attempts.append(m.value())
        raise RuntimeError("downstream is down")

    msgs = _records(registry, 0)
    raw = msgs[0].value()
    _strategy(p, _decoding(registry).handler(handler)).handle_fetched(msgs)
    assert attempts == [{"id": 0, "item": "i"}] * 3, "each attempt decodes from the original bytes"
    assert [(o, k, v) for o, k, v, _ in dlq.written] == [(0, b"k0", raw)]


def test_decode_in_place_keeps_the_original_bytes_when_it_fails(registry: SchemaRegistryClient) -> None:
    [msg] = _records(registry, 4, bad=4)
    with pytest.raises(DeserializationError, match="value deserializer"):
        _decoding(registry).decode(msg)
    assert (msg.key(), msg.value()) == (b"k4", b"\x00garbage"), "the key decoded first is restored too"
