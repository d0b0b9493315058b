"""Lab scenario `spark-task-retry` (failure mode L9): Spark write tasks fail on their first attempt after
writing half of their rows, and Spark retries them.

Spark's own Kafka sink (the control) writes those rows a second time; the reliable_kafka writer with
exactly_once writes every row once, and with at_least_once its copies carry one rk-id, so its dedup reader drops them.
Open clusters only: the control is Spark's Kafka sink, a Java client that takes no librdkafka login.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any

from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import count, result_from, topic_name
from reliable_kafka.testing.cluster import LocalKafkaCluster

log = logging.getLogger(__name__)

NAME = "spark-task-retry"
PARTITIONS = 4
ROWS_PER_PARTITION = 5_000


def _numbered(spark: Any, tag: str) -> tuple[Any, list[bytes]]:
    from pyspark.sql import functions as F

    total = PARTITIONS * ROWS_PER_PARTITION
    df = spark.range(0, total, 1, PARTITIONS).select(
        F.concat(F.lit(f"{tag}-"), F.lpad(F.col("id").cast("string"), 8, "0")).cast("binary").alias("value")
    )
    return df, [f"{tag}-{i:08d}".encode() for i in range(total)]


def run(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    from reliable_kafka.spark.api import read_kafka, write_kafka
    from reliable_kafka.spark.faults import fail_attempts
    from reliable_kafka.spark.java_options import java_kafka_options
    from reliable_kafka.spark.local import local_session

    bootstrap, conn = cluster.bootstrap_servers, cluster.client_config()
    # Ours take the cluster's librdkafka login as kafka.* options, the control (a Java client) its translation.
    login = {f"kafka.{k}": str(v) for k, v in conn.items() if k != "bootstrap.servers"}
    java = java_kafka_options(conn)
    progress("starting Spark", 0.0)
    spark = local_session(app_name="reliable-kafka-lab")
    spark.sparkContext.setLogLevel("FATAL")  # the injected task failures are expected: keep their traces quiet
    results = []
    try:
        def failing(tag: str) -> tuple[Any, list[bytes]]:
            # Every task's first attempt hands half its rows to the sink, then fails; Spark retries it.
            df, values = _numbered(spark, tag)
            return fail_attempts(df, after_rows=ROWS_PER_PARTITION // 2), values

        progress("control: Spark's Kafka sink", 0.1)
        started = time.monotonic()
        topic = topic_name(NAME, CONTROL)
        cluster.create_topic(topic, 3)
        df, values = failing(topic)
        df.write.format("kafka").options(**java).option("topic", topic).mode("append").save()
        results.append(count(NAME, CONTROL, values, conn, topic, started,
                             "Spark's Kafka sink: retried tasks write their rows again, without an rk-id"))

        progress("reliable_kafka: exactly_once", 0.4)
        started = time.monotonic()
        topic = topic_name(NAME, "eos")
        cluster.create_topic(topic, 3)
        df, values = failing(topic)
        write_kafka(df, bootstrap, topic, guarantee="exactly_once", write_id=f"lab-{uuid.uuid4().hex[:12]}",
                    num_partitions=PARTITIONS, options=login)
        results.append(count(NAME, RELIABLE, values, conn, topic, started,
                             "exactly_once: a retry resumes after its committed chunks (read_committed)"))

        progress("reliable_kafka: at_least_once + dedup reader", 0.7)
        started = time.monotonic()
        topic = topic_name(NAME, "alo")
        cluster.create_topic(topic, 3)
        df, values = failing(topic)
        write_kafka(df, bootstrap, topic, guarantee="at_least_once", write_id=f"lab-{uuid.uuid4().hex[:12]}",
                    options=login)
        raw = count(NAME, RELIABLE, values, conn, topic, started,
                    "at_least_once: copies share an rk-id; dups after dedup counted by the Spark dedup reader")
        deduped = read_kafka(spark, bootstrap, subscribe=topic, dedup_by_rk_id=True,
                             options=login).df.select("value").collect()
        after = result_from(NAME, RELIABLE, values, [(r.value, None) for r in deduped], started)
        results.append(dataclasses.replace(raw, duplicates_after_dedup=after.duplicates,
                                           seconds=time.monotonic() - started))
        progress("done", 1.0)
    finally:
        spark.stop()
    return results


SCENARIO = Scenario(
    name=NAME,
    description="L9 Spark task retry: write tasks fail after writing half their rows and are retried: Spark's "
    "Kafka sink duplicates them, reliable_kafka exactly_once writes each row once (at_least_once: copies share "
    "an rk-id)",
    run=run,
    needs=("spark",),
)
