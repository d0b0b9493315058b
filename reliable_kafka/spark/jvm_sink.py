"""at_least_once through Spark's own Kafka sink (a Java producer in each executor): no row crosses into Python.

The Python writer (writer.py) makes a Python call per row; this path hands the rows to Spark's JVM sink with
everything our at_least_once promises computed in Spark SQL beside them:

* the rk-id header, `<write id>:<Spark partition>:<row in the partition>`, the same as the Python writer's:
  a retried task re-sends its rows with the ids of their first copies;
* the Kafka partition of a row without key or partition, `(Spark partition + row // STICKY_ROWS) % n`, the
  Python writer's rule: a retry sends such a row where its first copy went (a per-partition dedup sees both);
  keyed rows go where the Java client's murmur2 puts them, as the Python writer's murmur2_random does;
* the producer: acks=all, idempotence, retries, the Python writer's batching; Spark's sink flushes before a
  task commits and fails the task on any send error, so a task succeeds only when every row was
  acknowledged, and a failed one is retried by Spark with the same rk-ids.

It is taken when it can give the same result: Spark's Kafka connector on the classpath, one topic, a
connection java_options can hand the Java client, and only tuning the two clients spell alike
(`jvm_sink_refusal` says why not).
"""

from __future__ import annotations

import logging
from typing import Any

from confluent_kafka.admin import AdminClient
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from reliable_kafka import telemetry
from reliable_kafka.admin import partition_count
from reliable_kafka.config import connection_settings
from reliable_kafka.errors import ConfigError, WriteRefused
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.spark.jars import has_kafka_connector
from reliable_kafka.spark.java_options import java_kafka_options
from reliable_kafka.spark.options import AT_LEAST_ONCE, WriterOptions
from reliable_kafka.spark.writer import STICKY_ROWS, check_input_schema

log = logging.getLogger(__name__)

# librdkafka settings the Java producer takes under the same name with the same meaning.
_SAME_NAMES = ("linger.ms", "batch.size", "compression.type", "acks", "enable.idempotence",
               "max.in.flight.requests.per.connection")
# monotonically_increasing_id() is (partition << 33) + the row's number in its partition.
_ROW_BITS = (1 << 33) - 1


def jvm_sink_refusal(spark: SparkSession, options: WriterOptions) -> str | None:
    """Why this write cannot go through Spark's own sink with the same result; None when it can."""
    if options.guarantee != AT_LEAST_ONCE:
        return "exactly_once writes through transactions, which Spark's own sink has not"
    if options.topic is None:
        return "the rows name their topics (a topic column): the partition rule needs one topic's partition count"
    if options.fail_first_attempt_after_rows is not None:
        return "test.failFirstAttemptAfterRows injects its fault in the Python writer"
    if telemetry.tracing_enabled():
        return "tracing is on: the Python writer carries each task's trace context in its records"
    other = sorted(k for k in options.kafka if k not in connection_settings(options.kafka) and k not in _SAME_NAMES)
    if other:
        return f"kafka.{other[0]} has no same-named setting in the Java client"
    try:
        java_kafka_options(connection_settings(options.kafka))
    except ConfigError as exc:
        return str(exc)
    if not has_kafka_connector(spark):
        return "Spark's Kafka connector (spark-sql-kafka-0-10) is not on the classpath"
    return None


def java_producer_options(options: WriterOptions) -> dict[str, str]:
    """The sink's `kafka.*` options: the connection, and the safe settings the Python writer would run with."""
    safe = options.producer_settings()  # validated: unsafe settings were refused on the driver already
    out = java_kafka_options(connection_settings(safe))
    # What producer_settings() enforces, in the Java client's spelling (librdkafka also takes acks=-1).
    out["kafka.acks"], out["kafka.enable.idempotence"] = "all", "true"
    for key in ("linger.ms", "batch.size", "compression.type", "max.in.flight.requests.per.connection"):
        if key in safe:
            out[f"kafka.{key}"] = str(safe[key])
    # Retry a send until its time is up, not for a count of attempts; the time is librdkafka's
    # message.timeout.ms (the Java client needs it at least request.timeout.ms + linger.ms).
    out["kafka.retries"] = str(2**31 - 1)
    timeout_ms = int(safe.get("message.timeout.ms", 0))
    if timeout_ms >= 30_000 + int(safe.get("linger.ms", 0)):
        out["kafka.delivery.timeout.ms"] = str(timeout_ms)
    return out


def _partition_count(options: WriterOptions, topic: str) -> int:
    count = partition_count(AdminClient(connection_settings(options.kafka)), topic)
    if count is None:
        raise WriteRefused(f"topic {topic!r} does not exist: create it before writing")
    return count


def with_rk_columns(df: DataFrame, write_id: str, partitions: int, *, block_rows: int = STICKY_ROWS) -> DataFrame:
    """`df` with the rk-id header appended to its headers and a partition for rows without key or partition.

    `block_rows`: rows without key or partition go to one Kafka partition per block of this many (the
    writer's STICKY_ROWS; benchmarks/spark_sink_blocks.py varies it)."""
    fields = set(df.columns)
    # One projection makes the row's numbers, read by the next: each call of monotonically_increasing_id()
    # counts a row, so it is computed once per row.
    numbered = df.select("*", F.spark_partition_id().alias("_rk_part"),
                         (F.monotonically_increasing_id().bitwiseAND(F.lit(_ROW_BITS))).alias("_rk_row"))
    rk_id = F.concat(F.lit(f"{write_id}:"), F.col("_rk_part").cast("string"), F.lit(":"),
                     F.col("_rk_row").cast("string")).cast("binary")
    header = F.struct(F.lit(ID_HEADER).alias("key"), rk_id.alias("value"))
    headers: Column = F.array(header)
    if "headers" in fields:
        headers = F.when(F.col("headers").isNull(), headers).otherwise(F.concat(F.col("headers"), headers))
    sticky = ((F.col("_rk_part") + F.floor(F.col("_rk_row") / block_rows)) % partitions).cast("int")
    unkeyed = F.col("key").isNull() if "key" in fields else F.lit(True)
    partition = F.when(unkeyed, sticky)
    if "partition" in fields:
        partition = F.coalesce(F.col("partition"), partition)
    keep = [c for c in ("key", "value") if c in fields]
    return numbered.select(*keep, headers.alias("headers"), partition.alias("partition"))


def write_with_jvm_sink(df: DataFrame, options: WriterOptions) -> None:
    """Write `df` at_least_once through Spark's own Kafka sink (jvm_sink_refusal() said it can)."""
    check_input_schema(df.schema, options)
    assert options.topic is not None
    frame = with_rk_columns(df, options.write_id, _partition_count(options, options.topic))
    sink: Any = frame.write.format("kafka").options(**java_producer_options(options)).option("topic", options.topic)
    log.info("write %s: at_least_once through Spark's own Kafka sink into %s", options.write_id, options.topic)
    sink.mode("append").save()
