"""Schema Registry deserializers through ReliableConsumer on the real cluster: records written by a plain
confluent Producer with confluent's own Avro / JSON Schema serializer (its mock:// registry) reach the
handler decoded, each once, none lost; an undecodable record lands in the dead-letter topic as consumed."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext, StringDeserializer

from reliable_kafka import ReliableConsumer, RetryPolicy
from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.dlq import parse_dead_letter_headers
from reliable_kafka.testing import consume_all
from tests.integration.test_consumer import _run_until, base_conf, committed

pytestmark = pytest.mark.cluster

ORDER_AVRO = json.dumps({"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "int"}, {"name": "item", "type": "string"}]})
ORDER_JSON = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}, "item": {"type": "string"}},
                         "required": ["id", "item"]})
N, PARTITIONS, POISON = 300, 3, b"written without the schema"


def _serdes(fmt: str, registry: SchemaRegistryClient) -> tuple[Any, Any]:
    if fmt == "avro":
        return AvroSerializer(registry, ORDER_AVRO), AvroDeserializer(registry)
    return JSONSerializer(ORDER_JSON, registry), JSONDeserializer(ORDER_JSON, schema_registry_client=registry)


@pytest.mark.parametrize("fmt", ["avro", "json"])
def test_schema_registry_records_are_decoded_once_each_and_the_undecodable_one_is_dead_lettered(
        kafka, make_topic, fmt: str) -> None:
    topic = make_topic(partitions=PARTITIONS)
    kafka.create_topic(f"{topic}.dlq", 1, 3)
    registry = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
    serializer, deserializer = _serdes(fmt, registry)
    ctx = SerializationContext(topic, MessageField.VALUE)
    p = Producer({"bootstrap.servers": kafka.bootstrap_servers, "acks": "all", "enable.idempotence": True})
    for i in range(N):
        produce_when_room(p, topic, serializer({"id": i, "item": f"item-{i}"}, ctx), key=f"k{i}".encode())
        if i == N // 2:
            produce_when_room(p, topic, POISON, key=b"poison")
    assert p.flush(60) == 0

    seen: Counter[int] = Counter()
    keys: set[str] = set()

    def handler(msg) -> None:
        order = msg.value()
        assert order == {"id": order["id"], "item": f"item-{order['id']}"}, order
        seen[order["id"]] += 1
        keys.add(msg.key())

    conf = base_conf(kafka)
    consumer = ReliableConsumer(conf, [topic], value_deserializer=deserializer,
                                key_deserializer=StringDeserializer(),
                                retry=RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05))
    _run_until(consumer, handler, lambda: len(seen) == N and consumer.stats().dead_lettered == 1)
    stats = consumer.stats()
    consumer.close()

    assert sorted(seen) == list(range(N)), "none lost"
    assert max(seen.values()) == 1, "none handled twice"
    assert keys == {f"k{i}" for i in range(N)}, "keys decoded too"
    assert (stats.handled, stats.dead_lettered) == (N + 1, 1)
    [dead] = list(consume_all(kafka.bootstrap_servers, f"{topic}.dlq"))
    assert (dead.value(), dead.key()) == (POISON, b"poison"), "the DLQ holds the record's original bytes"
    info = parse_dead_letter_headers(dead.headers())
    assert info.error_type.endswith("DeserializationError") and info.attempts == 2
    assert f"value deserializer failed on a record of topic '{topic}'" in info.error
    offsets = committed(kafka.bootstrap_servers, conf["group.id"], topic, PARTITIONS)
    assert sum(offsets.values()) == N + 1, f"every record committed, the dead-lettered one included: {offsets}"
