"""Schema Registry serializers through TransactionalProcessor on the real cluster: Avro inputs written by
ReliableProducer with confluent's AvroSerializer (its mock:// registry) are decoded for the transform, the
outputs are written JSON Schema encoded, and a record written without the schema is dead-lettered with its
original bytes; an independent read_committed reader finds every output exactly once and nothing lost.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Message
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext, StringDeserializer, StringSerializer

from reliable_kafka import ReliableProducer, RetryPolicy, TransactionalProcessor
from reliable_kafka.dlq import parse_dead_letter_headers
from reliable_kafka.testing import consume_all
from reliable_kafka.testing.gates import wait_for
from reliable_kafka.testing.offsets_probe import group_lag
from reliable_kafka.transactions import OutputRecord

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

ORDER_AVRO = json.dumps({"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "int"}, {"name": "item", "type": "string"}]})
CHARGE_JSON = json.dumps({"type": "object", "properties": {"order": {"type": "integer"}, "item": {"type": "string"}},
                          "required": ["order", "item"]})
N, PARTITIONS, POISON = 300, 3, b"written without the schema"


def test_avro_in_json_schema_out_exactly_once_and_the_undecodable_record_dead_lettered(
        kafka, make_topic, tmp_path: Path) -> None:
    bs = kafka.bootstrap_servers
    source = make_topic(partitions=PARTITIONS, prefix="serdes-in")
    output = make_topic(partitions=PARTITIONS, prefix="serdes-out")
    kafka.create_topic(f"{source}.dlq", 1)
    registry = SchemaRegistryClient.new_client({"url": f"mock://{uuid.uuid4().hex}"})
    with ReliableProducer({"bootstrap.servers": bs}, outbox_path=tmp_path / "o.db", key_serializer=StringSerializer(),
                          value_serializer=AvroSerializer(registry, ORDER_AVRO)) as p:
        for i in range(N):
            p.send(source, {"id": i, "item": f"item-{i}"}, key=f"k{i}")
            if i == N // 2:
                p.send(source, POISON, key=b"poison")  # bytes skip the serializer: no schema framing
        assert p.flush(60) == 0 and p.stats().delivered == N + 1

    transformed: Counter[int] = Counter()

    def charge(msg: Message) -> list[OutputRecord]:
        order = msg.value()
        transformed[order["id"]] += 1
        return [OutputRecord(output, {"order": order["id"], "item": order["item"].upper()}, key=msg.key())]

    group = f"serdes-{uuid.uuid4().hex[:6]}"
    processor = TransactionalProcessor(
        {"bootstrap.servers": bs, "group.id": group}, input_topics=[source], transform=charge,
        transactional_id=f"serdes-{uuid.uuid4().hex[:6]}",
        retry=RetryPolicy(attempts=2, initial_backoff_s=0.01, max_backoff_s=0.05, jitter=False),
        value_deserializer=AvroDeserializer(registry), key_deserializer=StringDeserializer(),
        value_serializer=JSONSerializer(CHARGE_JSON, registry), key_serializer=StringSerializer(),
    )
    with processor:
        runner = threading.Thread(target=processor.run, daemon=True)
        runner.start()
        assert wait_for(lambda: group_lag(bs, group, source) == 0, timeout_s=90), "the input was not processed"
        processor.stop()
        runner.join(60)
        assert not runner.is_alive(), "run() did not return after stop()"
    stats = processor.stats()

    deserializer = JSONDeserializer(CHARGE_JSON, schema_registry_client=registry)
    written: Counter[int] = Counter()
    for msg in consume_all(bs, output):  # read_committed, no group: an independent reader
        charge_ = deserializer(msg.value(), SerializationContext(output, MessageField.VALUE, msg.headers()))
        assert charge_ == {"order": charge_["order"], "item": f"ITEM-{charge_['order']}"}, charge_
        assert msg.key() == f"k{charge_['order']}".encode()
        written[charge_["order"]] += 1
    assert sorted(written) == list(range(N)), f"lost: {sorted(set(range(N)) - set(written))[:10]}"
    assert max(written.values()) == 1, f"duplicated: {[k for k, n in written.items() if n > 1][:10]}"
    assert set(transformed) == set(range(N)), "the transform saw every decoded input"
    [dead] = list(consume_all(bs, f"{source}.dlq"))
    assert (dead.value(), dead.key()) == (POISON, b"poison"), "the DLQ holds the record's original bytes"
    info = parse_dead_letter_headers(dead.headers())
    assert info.error_type.endswith("DeserializationError") and info.attempts == 2, info
    assert (stats.messages_committed, stats.dead_lettered) == (N + 1, 1), stats
