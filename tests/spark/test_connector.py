"""Spark's own Kafka connector (the control and the benchmark baseline) works on the installed Spark:
its sink writes and its reader reads back every row, and the version picked is one that can."""

from __future__ import annotations

import pytest

from reliable_kafka.spark.jars import compatible, installed_spark_version, spark_kafka_version
from reliable_kafka.testing.verify import verdict
from tests.spark.jobs import numbered_frame, read_back

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


def test_spark_kafka_connector_reads_and_writes_on_the_installed_spark(spark, kafka_connector, kafka,
                                                                        make_topic) -> None:
    assert compatible(spark_kafka_version(fetch=False), installed_spark_version())
    topic = make_topic(partitions=2)
    df, values = numbered_frame(spark, "conn", partitions=2, rows_per_partition=200)

    df.write.format("kafka").option("kafka.bootstrap.servers", kafka.bootstrap_servers).option(
        "topic", topic).mode("append").save()
    # The reader is what a connector of another release breaks first (NoClassDefFoundError in a task).
    got = [r.value for r in spark.read.format("kafka").option("kafka.bootstrap.servers", kafka.bootstrap_servers)
           .option("subscribe", topic).load().select("value").collect()]

    by_spark, by_plain_consumer = verdict(values, got), verdict(values, [m.value() for m in read_back(
        kafka.bootstrap_servers, topic)])
    for v in (by_spark, by_plain_consumer):
        assert (v.lost, v.duplicates) == (0, 0), v
