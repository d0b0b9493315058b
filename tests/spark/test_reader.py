"""The reliable_kafka Spark reader: committed rows only (aborted transactions skipped, none missing),
Spark's Kafka source columns, offset ranges, and group offsets committed only after a successful job."""

from __future__ import annotations

import json
import uuid

import pytest
from confluent_kafka import Producer

from reliable_kafka.spark import FORMAT, read_kafka
from reliable_kafka.testing.verify import verdict
from tests.spark.jobs import produce_with_aborted_transactions

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


def test_reader_returns_every_committed_row_and_no_aborted_one(spark, kafka, make_topic) -> None:
    topic = make_topic(partitions=2)
    committed, aborted = produce_with_aborted_transactions(kafka.bootstrap_servers, topic, 2)

    via_function = [r.value for r in read_kafka(spark, kafka.bootstrap_servers, subscribe=topic).df.collect()]
    via_format = [
        r.value
        for r in spark.read.format(FORMAT).option("kafka.bootstrap.servers", kafka.bootstrap_servers)
        .option("subscribe", topic).load().select("value").collect()
    ]

    for got in (via_function, via_format):
        v = verdict(committed, got)
        assert (v.acked, v.consumed, v.lost, v.duplicates) == (len(committed), len(committed), 0, 0), v
        assert not set(got) & set(aborted)


def test_reader_has_the_columns_and_values_of_spark_kafka_source(spark, kafka_connector, kafka, make_topic) -> None:
    topic = make_topic(partitions=2)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(40):
        producer.produce(topic, f"v{i}".encode(), key=None if i % 5 == 0 else f"k{i}".encode(),
                         headers=[("h", f"{i}".encode()), ("rk-id", None)] if i % 3 == 0 else None)
    assert producer.flush(30) == 0

    def load(fmt: str):
        return (spark.read.format(fmt).option("kafka.bootstrap.servers", kafka.bootstrap_servers)
                .option("subscribe", topic).option("includeHeaders", "true").load())

    ours, theirs = load(FORMAT), load("kafka")

    assert [(f.name, f.dataType) for f in ours.schema.fields] == [(f.name, f.dataType) for f in theirs.schema.fields]
    assert sorted(ours.collect(), key=lambda r: (r.partition, r.offset)) == sorted(
        theirs.collect(), key=lambda r: (r.partition, r.offset)
    )


def test_reader_offset_ranges_and_group_commit_only_after_success(spark, kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})

    def produce(start: int, count: int) -> None:
        for i in range(start, start + count):
            producer.produce(topic, f"r{i}".encode())
        assert producer.flush(30) == 0

    produce(0, 100)
    window = read_kafka(spark, kafka.bootstrap_servers, subscribe=topic,
                        starting_offsets=json.dumps({topic: {"0": 10}}), ending_offsets=json.dumps({topic: {"0": 20}}))
    assert sorted(r.offset for r in window.df.collect()) == list(range(10, 20))

    group = f"rk-spark-group-{uuid.uuid4().hex[:8]}"
    with read_kafka(spark, kafka.bootstrap_servers, subscribe=topic, group_id=group,
                    starting_offsets="committed") as batch:
        assert batch.df.count() == 100
    assert batch.committed

    produce(100, 50)
    with pytest.raises(RuntimeError, match="job failed"), read_kafka(
        spark, kafka.bootstrap_servers, subscribe=topic, group_id=group, starting_offsets="committed"
    ) as failed:
        assert failed.df.count() == 50
        raise RuntimeError("job failed")
    assert not failed.committed

    again = read_kafka(spark, kafka.bootstrap_servers, subscribe=topic, group_id=group, starting_offsets="committed")
    assert [r.value for r in again.df.orderBy("offset").collect()] == [f"r{i}".encode() for i in range(100, 150)]
    again.commit()
    rest = read_kafka(spark, kafka.bootstrap_servers, subscribe=topic, group_id=group, starting_offsets="committed")
    assert rest.df.count() == 0
