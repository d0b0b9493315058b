"""`reliable-kafka bench spark-stream`: Structured Streaming Kafka -> Kafka, our source and sink against Spark's own.

One input topic is filled once (unique 100-byte values); then every round runs each variant as a streaming
query from the input's earliest offsets to a fresh output topic, with a fresh checkpoint, the same
maxOffsetsPerTrigger and trigger(availableNow=True), timed from start() until the query terminates.
Rounds are interleaved (A B C, C B A) so load drift on the host hits every variant, and every run's
output is counted afterwards: a run that lost or duplicated rows fails the benchmark instead of
becoming a figure.
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from reliable_kafka.bench.common import Connection, round_order, rows_against, sampled_peak_rss_mb
from reliable_kafka.bench.spark import OUR_WRITER_BATCHING, TOPIC_PARTITIONS, VALUE_BYTES, reliable_kafka_login
from reliable_kafka.spark.java_options import java_kafka_options

log = logging.getLogger(__name__)

NAME = "spark-stream"
BASELINE = "spark_kafka_source_sink"
# Every variant reads in micro-batches of at most this many offsets. 100,000 rows (25,000 per input
# partition) is a trigger of seconds at these rates, as docs/spark.md recommends for a stream; a 1M-row
# run is then 10 micro-batches, so what each batch costs (planning, the checkpoint's offset and commit
# logs, a transaction and its markers per partition for exactly_once) is part of the figure, as it is in
# a real stream, and no variant gets the whole input as one unbounded batch.
MAX_OFFSETS_PER_TRIGGER = 100_000
# Unmeasured warm-up input (class loading, JIT, Python workers, the marker topic): one batch per variant.
WARM_UP_ROWS = 20_000
QUERY_TIMEOUT_S = 1800.0
COUNT_TIMEOUT_S = 300.0

# Starts one variant's streaming query: (input topic, output topic, checkpoint dir) -> its StreamingQuery.
StartQuery = Callable[[str, str, str], Any]


def check_delivered(variant: str, expected: int, found: int, topic: str) -> None:
    """A run whose output does not hold exactly the input's rows measured something else: refuse it."""
    if found != expected:
        what = "lost" if found < expected else "duplicated"
        raise RuntimeError(f"bench {NAME}: {variant} wrote {found:,} records to {topic}, not {expected:,} "
                           f"({abs(found - expected):,} {what}): not a measurement")


def fill_input(connection: Connection, topic: str, rows: int, prefix: str) -> None:
    """`rows` unique VALUE_BYTES-byte values, spread over the topic's partitions. Set-up, not measured: a
    raw idempotent producer with big batches, delivery reports only for failures."""
    from confluent_kafka import Producer

    failed: list[str] = []

    def on_error(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    p = Producer({**connection, "acks": "all", "enable.idempotence": True, "linger.ms": 20,
                  "batch.size": 1_000_000, "delivery.report.only.error": True})
    for i in range(rows):
        value = f"{prefix}-{i}".rjust(VALUE_BYTES, "x").encode()
        while True:
            try:
                p.produce(topic, value, on_delivery=on_error)
                break
            except BufferError:
                p.poll(0.05)  # the local queue is full: let deliveries drain it
        if i % 10_000 == 0:
            p.poll(0)
    left = p.flush(300)
    if failed or left:
        raise RuntimeError(f"bench {NAME}: filling {topic} failed ({left} undelivered): {failed[:3]}")


def end_offsets_count(connection: Connection, topic: str) -> int:
    """Records in a fresh topic written without transactions: its end offsets minus its start offsets."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({**connection, "group.id": f"rk-bench-count-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False})
    try:
        partitions = c.list_topics(topic, timeout=30).topics[topic].partitions
        total = 0
        for p in partitions:
            low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=30)
            total += high - low
        return total
    finally:
        c.close()


def committed_count(connection: Connection, topic: str) -> int:
    """Records of committed transactions in `topic`, read to its end with a read_committed consumer.

    End offsets would count aborted records (a retried chunk's) and transaction markers too, and how many
    of those there are is what is being checked, so the records are read: cheap next to the run (a
    read_committed client skips aborted records and markers itself), and independent of our sink's own
    bookkeeping (its manifests).
    """
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    c = Consumer({**connection, "group.id": f"rk-bench-count-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
                  "isolation.level": "read_committed", "enable.partition.eof": True,
                  "fetch.max.bytes": 50_000_000, "max.partition.fetch.bytes": 10_000_000})
    try:
        partitions = list(c.list_topics(topic, timeout=30).topics[topic].partitions)
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        at_end: set[int] = set()
        count = 0
        deadline = time.monotonic() + COUNT_TIMEOUT_S
        while len(at_end) < len(partitions):
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench {NAME}: counting {topic} took over {COUNT_TIMEOUT_S:.0f} s")
            for msg in c.consume(10_000, timeout=1.0):
                err, partition = msg.error(), msg.partition()
                if err is None:
                    count += 1
                    at_end.discard(partition if partition is not None else -1)
                elif err.code() == KafkaError._PARTITION_EOF and partition is not None:
                    at_end.add(partition)
                else:
                    raise RuntimeError(f"bench {NAME}: counting {topic}: {err}")
        return count
    finally:
        c.close()


def run_spark_stream_bench(
    connection: Connection,
    rows: int,
    create_topic: Callable[[str, int], None],
    *,
    rounds: int = 3,
    max_offsets_per_trigger: int = MAX_OFFSETS_PER_TRIGGER,
) -> list[dict[str, Any]]:
    """Measure Spark's Kafka source + sink, our at_least_once and our exactly_once source + sink on `rows` rows.

    Returns one row per variant (records/s in msgs_per_s, the median of `rounds`; the baseline has ratio
    1.0) and, for context, Spark's source + sink with our writer's batching. `max_offsets_per_trigger` is
    every variant's maxOffsetsPerTrigger. Spark's connector logs in with
    the same settings, translated by java_kafka_options(): every variant takes the same cluster path.
    """
    bootstrap_servers = str(connection["bootstrap.servers"])
    login = reliable_kafka_login(connection)
    java = java_kafka_options(connection)  # refuses a login it cannot hand the Java client, before Spark starts

    from reliable_kafka.spark.local import local_session

    def fresh_topic(kind: str) -> str:
        name = f"rk-bench-stream-{kind}-{uuid.uuid4().hex[:10]}"
        create_topic(name, TOPIC_PARTITIONS)
        return name

    source = fresh_topic("in")
    warm_source = fresh_topic("warm")
    log.info("bench %s: filling %s with %d rows", NAME, source, rows)
    tag = uuid.uuid4().hex[:8]
    fill_input(connection, source, rows, tag)
    fill_input(connection, warm_source, min(WARM_UP_ROWS, rows), f"warm-{tag}")

    spark = local_session(app_name="reliable-kafka-bench-stream")
    try:
        def spark_query(**sink_tuning: str) -> StartQuery:
            """Spark's own connector, as a careful user sets it up: the Java producer with acks=all and
            idempotence (Kafka 3.x clients' defaults, set explicitly so a cluster's or an older client's
            defaults cannot change them), the source read_committed as ours reads; key and value only."""
            def start(topic_in: str, topic_out: str, checkpoint: str) -> Any:
                stream = (spark.readStream.format("kafka").options(**java).option("subscribe", topic_in)
                          .option("startingOffsets", "earliest")
                          .option("maxOffsetsPerTrigger", str(max_offsets_per_trigger))
                          .option("kafka.isolation.level", "read_committed").load())
                return (stream.select("key", "value").writeStream.format("kafka").options(**java)
                        .option("kafka.acks", "all").option("kafka.enable.idempotence", "true")
                        .options(**sink_tuning).option("topic", topic_out)
                        .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())

            return start

        def ours(guarantee: str) -> StartQuery:
            """Our source (always read_committed) and sink with their defaults (writer batching: linger.ms=20,
            batch.size=1000000; exactly_once: one transaction per Spark partition and chunk of chunkRows)."""
            def start(topic_in: str, topic_out: str, checkpoint: str) -> Any:
                stream = (spark.readStream.format("reliable_kafka")
                          .option("kafka.bootstrap.servers", bootstrap_servers).options(**login)
                          .option("subscribe", topic_in).option("startingOffsets", "earliest")
                          .option("maxOffsetsPerTrigger", str(max_offsets_per_trigger)).load())
                return (stream.select("key", "value").writeStream.format("reliable_kafka")
                        .option("kafka.bootstrap.servers", bootstrap_servers).options(**login)
                        .option("topic", topic_out).option("guarantee", guarantee)
                        .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())

            return start

        # Each variant's query, and whether its output is transactional (counted by a read_committed read).
        variants: dict[str, tuple[StartQuery, bool]] = {
            BASELINE: (spark_query(), False),
            "at_least_once": (ours("at_least_once"), False),
            "exactly_once": (ours("exactly_once"), True),
            # Context, not a target: Spark's source + sink with our writer's batching.
            f"{BASELINE}_batched": (spark_query(**OUR_WRITER_BATCHING), False),
        }

        def run(name: str, topic_in: str, expected: int) -> dict[str, Any]:
            start, transactional = variants[name]
            topic_out = fresh_topic("out")
            with tempfile.TemporaryDirectory(prefix="rk-bench-stream-") as checkpoint, \
                    sampled_peak_rss_mb() as peak:
                started = time.perf_counter()
                query = start(topic_in, topic_out, checkpoint)
                try:
                    finished = query.awaitTermination(QUERY_TIMEOUT_S)
                finally:
                    seconds = time.perf_counter() - started
                    query.stop()
                if not finished:
                    raise RuntimeError(f"bench {NAME}: {name} did not finish within {QUERY_TIMEOUT_S:.0f} s")
                if query.exception() is not None:
                    raise RuntimeError(f"bench {NAME}: {name} failed: {query.exception()}")
                progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
            found = committed_count(connection, topic_out) if transactional else end_offsets_count(connection,
                                                                                                   topic_out)
            check_delivered(name, expected, found, topic_out)
            return {
                "msgs_per_s": expected / seconds, "peak_rss_mb": peak[0], "seconds": seconds,
                "micro_batches": len(progress),
                # Where a run's time went, from Spark's progress reports: the batches' own work (read and
                # write: addBatch) against the rest (planning offsets, the checkpoint's logs, start-up).
                "add_batch_s": sum(p["durationMs"].get("addBatch", 0) for p in progress) / 1000,
                "trigger_s": sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000,
            }

        for name in variants:
            log.info("bench %s: warming up %s", NAME, name)
            run(name, warm_source, min(WARM_UP_ROWS, rows))

        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for round_no in range(rounds):
            for name in round_order(list(variants), round_no):
                result = run(name, source, rows)
                log.info("bench %s round %d: %s %.0f records/s (%.1f s, %d micro-batches, addBatch %.1f s)",
                         NAME, round_no + 1, name, result["msgs_per_s"], result["seconds"],
                         result["micro_batches"], result["add_batch_s"])
                runs[name].append(result)
    finally:
        spark.stop()
    rows_out = []
    for row in rows_against(NAME, BASELINE, runs, rows):
        # Every run's timing breakdown beside its rate, in round order.
        detail = {key: [round(r[key], 2) for r in runs[row.variant]]
                  for key in ("seconds", "add_batch_s", "trigger_s", "micro_batches")}
        rows_out.append(replace(row, extra={**row.extra, "max_offsets_per_trigger": max_offsets_per_trigger,
                                            **{f"{k}_runs": v for k, v in detail.items()}}).as_json())
    return rows_out
