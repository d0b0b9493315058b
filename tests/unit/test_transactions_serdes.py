"""The processor's (de)serializers around its transform: the transform sees inputs decoded by confluent's
Schema Registry deserializers (mock:// registry) and its outputs are encoded for their topic, a header the
serializer adds included; an input that cannot be decoded, or outputs that cannot be encoded, fail like the
transform and are dead-lettered with the bytes the input was consumed with; without them nothing is wrapped.
Then the processor's stats(): every name from the start, a Stats. No broker.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
from confluent_kafka import Message
from confluent_kafka.schema_registry import SchemaRegistryClient, header_schema_id_serializer
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from reliable_kafka import RetryPolicy, Stats, TransactionalProcessor
from reliable_kafka.dlq import parse_dead_letter_headers
from reliable_kafka.transactions import ProcessorStats
from reliable_kafka.transactions.checkpoint import STATS as PROCESSOR_STATS
from reliable_kafka.transactions.coding import coded
from reliable_kafka.transactions.failures import TransformFailures
from reliable_kafka.transactions.records import OutputRecord

ORDER_AVRO = json.dumps({"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "int"}, {"name": "item", "type": "string"}]})
CHARGE_JSON = json.dumps({"type": "object", "properties": {"order": {"type": "integer"}}, "required": ["order"]})
IN, OUT = "orders", "charges"


@pytest.fixture
def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": f"mock://txn-serdes-{uuid.uuid4().hex[:8]}"})


def record(value: bytes | None, key: bytes | None = b"k", offset: int = 0) -> Message:
    return Message(topic=IN, partition=0, offset=offset, value=value, key=key, headers=[("rk-id", b"in-1")])


def charge(msg: Message) -> list[OutputRecord]:
    order = msg.value()
    assert isinstance(order, dict), f"the transform sees the decoded value, got {order!r}"
    return [OutputRecord(OUT, {"order": order["id"]}, key=msg.key())]


def avro_bytes(registry: SchemaRegistryClient, order: dict[str, Any]) -> bytes:
    out = AvroSerializer(registry, ORDER_AVRO)(order, SerializationContext(IN, MessageField.VALUE))
    assert out is not None
    return out


def test_without_serdes_the_transform_is_not_wrapped() -> None:
    assert coded(charge, value_deserializer=None, key_deserializer=None, value_serializer=None,
                 key_serializer=None) is charge


def test_the_transform_sees_the_input_decoded_and_its_outputs_leave_encoded(registry: SchemaRegistryClient) -> None:
    transform = coded(charge, value_deserializer=AvroDeserializer(registry), key_deserializer=bytes.decode,
                      value_serializer=JSONSerializer(CHARGE_JSON, registry), key_serializer=str.encode)
    msg = record(avro_bytes(registry, {"id": 7, "item": "tea"}))
    [out] = transform(msg)
    assert out.topic == OUT and out.key == b"k", "the key went str (decoded) -> bytes (encoded)"
    assert type(out.value) is bytes
    decoded = JSONDeserializer(CHARGE_JSON, schema_registry_client=registry)(
        out.value, SerializationContext(OUT, MessageField.VALUE))
    assert decoded == {"order": 7}
    assert registry.get_latest_version(f"{OUT}-value") is not None, "registered under the output topic's subject"
    assert out.headers is None, "no headers given and none added: the output keeps the rk-id-only path"


def test_a_header_the_output_serializer_adds_is_written_with_the_output(registry: SchemaRegistryClient) -> None:
    serializer = AvroSerializer(registry, ORDER_AVRO, conf={"schema.id.serializer": header_schema_id_serializer})

    def copy(msg: Message) -> list[OutputRecord]:
        return [OutputRecord(OUT, {"id": 1, "item": "a teapot"}, headers={"app": b"shop"}),
                OutputRecord(OUT, b"raw bytes skip the serializer")]

    first, second = coded(copy, value_deserializer=None, key_deserializer=None, value_serializer=serializer,
                          key_serializer=None)(record(b"anything"))
    names = [name for name, _ in first.headers]
    assert names == ["app", "__value_schema_id"], names
    assert AvroDeserializer(registry)(first.value, SerializationContext(OUT, MessageField.VALUE, first.headers)) == {
        "id": 1, "item": "a teapot"}
    assert second.value == b"raw bytes skip the serializer" and second.headers is None


def failures(transform: Any) -> TransformFailures:
    retry = RetryPolicy(attempts=2, initial_backoff_s=0.001, max_backoff_s=0.001)
    return TransformFailures(transform, retry, "{topic}.dlq", [IN], threading.Event())


def test_an_undecodable_input_is_retried_then_dead_lettered_with_its_original_bytes(
        registry: SchemaRegistryClient) -> None:
    calls: list[Message] = []

    def transform(msg: Message) -> list[OutputRecord]:
        calls.append(msg)
        return charge(msg)

    coded_transform = coded(transform, value_deserializer=AvroDeserializer(registry), key_deserializer=bytes.decode,
                            value_serializer=None, key_serializer=None)
    msg = record(b"\x00\x00\x00\x00\x63 not avro", key=b"k-raw")
    with pytest.raises(Exception) as first:
        coded_transform(msg)
    assert (msg.value(), msg.key()) == (b"\x00\x00\x00\x00\x63 not avro", b"k-raw"), "restored after the failure"
    outputs, dead = failures(coded_transform).after_failure(msg, first.value)
    assert dead and calls == [], "the transform never ran on an undecodable record"
    [copy] = outputs
    assert copy.topic == f"{IN}.dlq"
    assert (copy.value, copy.key) == (b"\x00\x00\x00\x00\x63 not avro", b"k-raw"), "the bytes as consumed"
    info = parse_dead_letter_headers(copy.headers)
    assert info.error_type.endswith("DeserializationError") and info.attempts == 2, info


def test_outputs_that_cannot_be_encoded_dead_letter_the_input_as_consumed(registry: SchemaRegistryClient) -> None:
    def bad(msg: Message) -> list[OutputRecord]:
        return [OutputRecord(OUT, {"order": "not an integer"})]

    raw = avro_bytes(registry, {"id": 3, "item": "pen"})
    coded_transform = coded(bad, value_deserializer=AvroDeserializer(registry), key_deserializer=None,
                            value_serializer=JSONSerializer(CHARGE_JSON, registry), key_serializer=None)
    msg = record(raw)
    with pytest.raises(Exception) as first:
        coded_transform(msg)
    assert msg.value() == raw, "the input holds its consumed bytes again"
    outputs, dead = failures(coded_transform).after_failure(msg, first.value)
    assert dead and outputs[0].value == raw
    assert parse_dead_letter_headers(outputs[0].headers).error_type.endswith("SerializationError")


def test_a_generator_transform_that_fails_midway_still_restores_the_input(registry: SchemaRegistryClient) -> None:
    def gen(msg: Message) -> Any:
        yield OutputRecord(OUT, b"one")
        raise RuntimeError("second output failed")

    raw = avro_bytes(registry, {"id": 4, "item": "cup"})
    msg = record(raw)
    with pytest.raises(RuntimeError):
        coded(gen, value_deserializer=AvroDeserializer(registry), key_deserializer=None, value_serializer=None,
              key_serializer=None)(msg)
    assert msg.value() == raw


def test_the_processor_reports_every_name_from_the_start_as_stats() -> None:
    p = TransactionalProcessor({"bootstrap.servers": "127.0.0.1:9", "group.id": "g"}, input_topics=[IN],
                               transform=charge, transactional_id="t-1",
                               value_deserializer=json.loads, value_serializer=lambda v: json.dumps(v).encode())
    s = p.stats()
    assert isinstance(s, Stats) and ProcessorStats is Stats, "the old name stays importable, for one release"
    assert dict(s) == dict.fromkeys(PROCESSOR_STATS, 0)
    assert s.transactions_committed == 0 and s["rewinds"] == 0
