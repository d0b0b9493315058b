"""The Spark connector on a secured cluster: SASL/SCRAM over TLS with real ACLs, the login passed as
`kafka.*` options. An exactly-once write (transactions, its marker topic) and a read as a consumer group
return every row once, and the password shows in no plan Spark prints. Spark's own sink (the controls'
and baselines' Java client) logs in with the same settings, translated."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from reliable_kafka.spark import read_kafka, write_kafka
from reliable_kafka.testing import LocalKafkaCluster
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS
from reliable_kafka.testing.verify import verdict
from tests.fixtures.kafka import _require_kafka

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


@pytest.fixture(scope="module")
def secured() -> Iterator[LocalKafkaCluster]:
    _require_kafka()
    with LocalKafkaCluster(brokers=1, jvm_options=QUICK_START_JVM_OPTIONS, security="sasl-scram+tls") as cluster:
        cluster.wait_healthy()
        yield cluster


def test_an_exactly_once_write_and_a_group_read_over_scram_and_tls(spark, secured: LocalKafkaCluster) -> None:
    conn = secured.client_config()
    bootstrap = conn.pop("bootstrap.servers")
    login = {f"kafka.{k}": v for k, v in conn.items()}
    topic = f"sec-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 2, 1)
    values = [f"row-{i}" for i in range(400)]
    df = spark.createDataFrame([(v[-3:], v) for v in values], "key string, value string").repartition(2)

    result = write_kafka(df, bootstrap, topic, guarantee="exactly_once", write_id=f"w-{uuid.uuid4().hex[:8]}",
                         num_partitions=2, options=login)
    assert result.rows == len(values)
    group = f"g-{uuid.uuid4().hex[:8]}"
    with read_kafka(spark, bootstrap, subscribe=topic, group_id=group, options=login) as batch:
        got = [r.value for r in batch.df.select("value").collect()]
        plan = batch.df._jdf.queryExecution().toString()
    v = verdict([x.encode() for x in values], got)
    assert (v.lost, v.duplicates, v.consumed) == (0, 0, len(values)), v
    assert conn["sasl.password"] not in plan


def test_spark_own_kafka_sink_logs_in_with_the_translated_settings(
    spark, kafka_connector, secured: LocalKafkaCluster
) -> None:
    """The controls and baselines that run Spark's own connector (a Java client) beside ours reach the same
    secured cluster as the same principal: java_kafka_options() turns the librdkafka login into a JAAS line
    and the CA into a PEM truststore."""
    from reliable_kafka.spark.java_options import java_kafka_options

    conn = secured.client_config()
    topic = f"sec-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 2, 1)
    values = [f"java-{i}" for i in range(100)]
    df = spark.createDataFrame([(v,) for v in values], "value string")
    df.write.format("kafka").options(**java_kafka_options(conn)).option("topic", topic).mode("append").save()
    bootstrap = conn.pop("bootstrap.servers")
    got = [r.value for r in read_kafka(spark, bootstrap, subscribe=topic,
                                       options={f"kafka.{k}": v for k, v in conn.items()}).df.collect()]
    v = verdict([x.encode() for x in values], got)
    assert (v.lost, v.duplicates) == (0, 0), v
