"""`reliable-kafka bench spark`: our Spark writer against Spark's own Kafka sink, same DataFrame, cluster and run.

Each variant writes the same rows (unique 100-byte values, same Spark partitions) to its own fresh topic
with the same partition count; rounds are interleaved so load drift on the host hits every variant.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from reliable_kafka.bench.common import Connection, round_order, rows_against, sampled_peak_rss_mb
from reliable_kafka.spark.java_options import java_kafka_options
from reliable_kafka.spark.options import _SPARK_PRODUCER_DEFAULTS

log = logging.getLogger(__name__)

BASELINE = "spark_kafka_sink"
# The like-for-like baseline the targets are on: Spark's sink with the batching our writer uses.
BATCHED = f"{BASELINE}_batched"
VALUE_BYTES = 100
SPARK_PARTITIONS = 4
TOPIC_PARTITIONS = 4
# Context rows run Spark's sink with the batching our writer uses by default (the Java client's own
# defaults send 16 KB batches without lingering).
OUR_WRITER_BATCHING = {f"kafka.{k}": str(_SPARK_PRODUCER_DEFAULTS[k]) for k in ("linger.ms", "batch.size")}


def reliable_kafka_login(connection: Connection) -> dict[str, str]:
    """The connection's settings other than the brokers, as `kafka.*` options of format("reliable_kafka")."""
    return {f"kafka.{k}": str(v) for k, v in connection.items() if k != "bootstrap.servers"}


def run_spark_bench(
    connection: Connection,
    rows: int,
    create_topic: Callable[[str, int], None],
    *,
    rounds: int = 3,
) -> list[dict[str, Any]]:
    """Measure Spark's Kafka sink, our at_least_once and our exactly_once writer on `rows` rows.

    Returns one row per variant against Spark's sink at the Java client's defaults (the rows earlier runs
    reported), then ours against Spark's sink with our writer's batching (BATCHED: the targets are on those).
    at_least_once goes through Spark's own sink with rk-ids computed in Spark SQL (write_kafka's "auto"
    path, spark/jvm_sink.py); `at_least_once_python` is the same write through format("reliable_kafka").
    msgs_per_s is the median of `rounds` (each round runs every variant).
    The baseline (Spark's own sink, a Java client) logs in with the same settings, translated by
    java_kafka_options(): both sides take the same cluster path, TLS and login included.
    """
    bootstrap_servers = str(connection["bootstrap.servers"])
    login = reliable_kafka_login(connection)
    java = java_kafka_options(connection)  # refuses a login it cannot hand the Java client, before Spark starts
    from pyspark.sql import functions as F

    from reliable_kafka.spark.api import write_kafka
    from reliable_kafka.spark.local import local_session

    spark = local_session(app_name="reliable-kafka-bench")
    try:
        df = spark.range(0, rows, 1, SPARK_PARTITIONS).select(
            F.expr(f"cast(lpad(cast(id as string), {VALUE_BYTES}, 'x') as binary)").alias("value")
        )

        def spark_sink(**tuning: str) -> Callable[[Any, str], None]:
            def write(frame: Any, topic: str) -> None:
                writer = frame.write.format("kafka").options(**java)
                writer.options(**tuning).option("topic", topic).mode("append").save()

            return write

        def ours(guarantee: str, path: str = "auto") -> Callable[[Any, str], None]:
            def write(frame: Any, topic: str) -> None:
                result = write_kafka(
                    frame, bootstrap_servers, topic, guarantee=guarantee,
                    write_id=f"bench-{uuid.uuid4().hex[:12]}", num_partitions=SPARK_PARTITIONS, options=login,
                    write_path=path,
                )
                log.debug("bench spark: %s %s wrote through the %s writer", guarantee, path, result.path)

            return write

        variants: dict[str, Callable[[Any, str], None]] = {
            BASELINE: spark_sink(),
            "at_least_once": ours("at_least_once", "jvm"),
            "at_least_once_python": ours("at_least_once", "python"),
            "exactly_once": ours("exactly_once"),
            BATCHED: spark_sink(**OUR_WRITER_BATCHING),
        }

        def fresh_topic() -> str:
            name = f"rk-bench-spark-{uuid.uuid4().hex[:10]}"
            create_topic(name, TOPIC_PARTITIONS)
            return name

        # Warm-up: class loading, JIT, Python workers and the marker topic are not part of a measurement.
        warm = df.limit(SPARK_PARTITIONS * 1000).repartition(SPARK_PARTITIONS)
        for name, write in variants.items():
            log.info("bench spark: warming up %s", name)
            write(warm, fresh_topic())

        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for round_no in range(rounds):
            for name in round_order(list(variants), round_no):
                write = variants[name]
                topic = fresh_topic()
                with sampled_peak_rss_mb() as peak:
                    started = time.perf_counter()
                    write(df, topic)
                    seconds = time.perf_counter() - started
                rate = rows / seconds
                log.info("bench spark round %d: %s %.0f msgs/s (%.1fs)", round_no + 1, name, rate, seconds)
                runs[name].append({"msgs_per_s": rate, "peak_rss_mb": peak[0]})
    finally:
        spark.stop()
    ours_runs = {v: runs[v] for v in ("at_least_once", "at_least_once_python", "exactly_once")}
    return [row.as_json() for row in [*rows_against("spark", BASELINE, runs, rows),
                                      *rows_against("spark", BATCHED, {BATCHED: runs[BATCHED], **ours_runs}, rows)]]
