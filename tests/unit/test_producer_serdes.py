"""The producer's serializers: confluent's Schema Registry Avro / JSON Schema serializers (mock:// registry)
encode what send() accepts, with the topic's subject and the message's headers in their SerializationContext;
a header a serializer adds is sent (librdkafka mock cluster); a failing one spools nothing; bytes skip it.
Then the producer's stats(): every name from the start, and `counts` deprecated, pointing at the caller.
"""

from __future__ import annotations

import io
import json
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient, header_schema_id_serializer
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext, Serializer, StringSerializer

from reliable_kafka import ReliableProducer, SerializationError, Stats
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.producer import Serializer as ProducerSerializer
from reliable_kafka.producer.dispatcher import STATS as PRODUCER_STATS
from reliable_kafka.producer.messages import Message, Preparer
from reliable_kafka.testing.mock import MockCluster

ORDER_AVRO = json.dumps({"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "int"}, {"name": "item", "type": "string"}]})
SCHEMA = fastavro.parse_schema(json.loads(ORDER_AVRO))
ORDER_JSON = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})
NOWHERE = {"bootstrap.servers": "127.0.0.1:9"}  # never contacted
T = "orders"


@pytest.fixture
def registry() -> SchemaRegistryClient:
    return SchemaRegistryClient.new_client({"url": f"mock://producer-serdes-{uuid.uuid4().hex[:8]}"})


def prepared(value_serializer: Any = None, key_serializer: Any = None, **message: Any) -> Any:
    return Preparer(value_serializer, key_serializer, spans=None).prepare(Message(T, **message), "fresh")


def test_avro_values_are_encoded_under_the_topics_subject(registry: SchemaRegistryClient) -> None:
    row = prepared(AvroSerializer(registry, ORDER_AVRO), StringSerializer(), value={"id": 7, "item": "tea"},
                   key="k-7")
    assert row.key == b"k-7"
    assert registry.get_latest_version(f"{T}-value").schema.schema_str is not None, "registered as orders-value"
    decoded = AvroDeserializer(registry)(row.value, SerializationContext(T, MessageField.VALUE, list(row.headers)))
    assert decoded == {"id": 7, "item": "tea"}


def test_json_schema_values_are_validated_and_a_bad_one_is_serialization_error_chained(
        registry: SchemaRegistryClient) -> None:
    serializer = JSONSerializer(ORDER_JSON, registry)
    row = prepared(serializer, value={"id": 1})
    assert JSONDeserializer(ORDER_JSON, schema_registry_client=registry)(
        row.value, SerializationContext(T, MessageField.VALUE)) == {"id": 1}
    with pytest.raises(SerializationError, match=r"value serializer failed on a dict for topic 'orders'") as caught:
        prepared(serializer, value={"id": "not an integer"})
    assert caught.value.__cause__ is not None and caught.value.topic == T


class Recording(Serializer):
    """Records the context it is called with, and adds a header as a schema-id serializer does."""

    def __init__(self) -> None:
        self.contexts: list[SerializationContext] = []

    def __call__(self, obj: Any, ctx: SerializationContext | None = None) -> bytes:
        assert ctx is not None
        self.contexts.append(ctx)
        assert isinstance(ctx.headers, list)
        ctx.headers.append(("schema", "v1"))  # a str: the producer makes it bytes like the rest
        return repr(obj).encode()


def test_the_serializer_sees_the_headers_and_what_it_adds_is_kept() -> None:
    serializer = Recording()
    row = prepared(serializer, value={"a": 1}, headers={"trace": "t-1", ID_HEADER: "caller-id"})
    ctx = serializer.contexts[0]
    assert (ctx.topic, ctx.field) == (T, MessageField.VALUE)
    assert ctx.headers == [("trace", b"t-1"), (ID_HEADER, b"caller-id"), ("schema", "v1")], "the list it saw"
    assert row.headers == (("trace", b"t-1"), ("schema", b"v1")), "the added header is sent, made bytes"
    assert row.message_id == "caller-id", "the caller's rk-id header is still its id"


def test_bytes_skip_the_serializer_and_none_is_not_passed_to_it() -> None:
    serializer = Recording()
    row = prepared(serializer, serializer, value=b"raw", key=b"k")
    assert (row.value, row.key) == (b"raw", b"k") and serializer.contexts == [], "no call for bytes"
    assert prepared(serializer, value=None).value is None and serializer.contexts == [], "a tombstone stays None"


def test_a_failing_serializer_spools_nothing_and_a_plain_function_still_works(tmp_path: Path) -> None:
    assert ProducerSerializer is not None  # the old name is still importable

    def boom(_: object) -> bytes:
        raise ValueError("no schema for that")

    with ReliableProducer(NOWHERE, outbox_path=tmp_path / "o.db", preflight="off", value_serializer=boom) as p:
        with pytest.raises(SerializationError, match="value_serializer") as caught:
            p.send_many([(T, b"fine"), (T, {"not": "encodable"})])
        assert isinstance(caught.value.__cause__, ValueError)
        assert p.pending == 0, "a refused batch spools nothing"
        p.close(0.1)


# ---- a header a Schema Registry serializer adds arrives with the record --------------------------------


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as mock:
        yield mock


def test_a_schema_id_header_added_by_avro_serializer_is_what_is_sent(
        cluster: MockCluster, registry: SchemaRegistryClient, tmp_path: Path) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    cluster.create_topic(topic, partitions=1, replication_factor=3)
    boot = {"bootstrap.servers": cluster.bootstrap_servers}
    serializer = AvroSerializer(registry, ORDER_AVRO, conf={"schema.id.serializer": header_schema_id_serializer})
    with ReliableProducer(boot, outbox_path=tmp_path / "o.db", value_serializer=serializer) as p:
        sent = [p.send(topic, {"id": i, "item": f"item-{i}"}, headers={"app": "shop"}) for i in range(3)]
        assert p.flush(30) == 0
        assert [p.state(s) for s in sent] == ["delivered"] * 3
        assert p.stats().delivered == 3 and p.stats().sent == 3
    reader = Consumer({**boot, "group.id": f"g-{topic}", "auto.offset.reset": "earliest"})
    reader.subscribe([topic])
    got: list[Any] = []
    try:
        while len(got) < 3:
            msg = reader.poll(10)
            assert msg is not None, f"only {len(got)} of 3 records came back"
            assert msg.error() is None, msg.error()
            got.append(msg)
    finally:
        reader.close()
    deserializer = AvroDeserializer(registry)
    for i, msg in enumerate(got):
        headers = dict(msg.headers() or [])
        assert headers["app"] == b"shop" and ID_HEADER in headers
        assert "__value_schema_id" in headers, f"the serializer's header is missing: {sorted(headers)}"
        # The payload is the bare Avro record: the schema id travels in the header, not as a prefix.
        assert fastavro.schemaless_reader(io.BytesIO(msg.value()), SCHEMA) == {"id": i, "item": f"item-{i}"}
        value = deserializer(msg.value(), SerializationContext(topic, MessageField.VALUE, msg.headers()))
        assert value == {"id": i, "item": f"item-{i}"}


# ---- stats() ---------------------------------------------------------------------------------------------


def test_the_producer_reports_every_name_from_the_start(tmp_path: Path) -> None:
    with ReliableProducer(NOWHERE, durability="memory", preflight="off") as p:
        s = p.stats()
        p.close(0.1)
    assert isinstance(s, Stats)
    assert dict(s) == dict.fromkeys(PRODUCER_STATS, 0)
    assert tuple(PRODUCER_STATS) == ("sent", "delivered", "failed", "retried", "recreated", "commits")


def test_the_producers_counts_still_work_and_name_stats() -> None:
    with ReliableProducer(NOWHERE, durability="memory", preflight="off") as p:
        p.send(T, b"v")
        expected = r"ReliableProducer\.counts is deprecated .*: use ReliableProducer\.stats\(\) instead"
        with pytest.warns(DeprecationWarning, match=expected) as caught:
            counts = p.counts
        assert caught[0].filename == __file__  # pointing at the caller, not at the library
        assert type(counts) is dict and counts == dict(p.stats()) and counts["sent"] == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            p.stats()
        p.close(0.1)
