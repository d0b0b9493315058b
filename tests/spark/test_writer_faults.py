"""Spark write tasks that fail after writing: exactly_once loses and duplicates nothing, at_least_once loses
nothing and every copy carries the same rk-id, Spark's own Kafka sink (the control) duplicates.

Failures are injected deterministically: upstream of the sink (fail_attempts: the same failing job for
Spark's sink and ours) or by the writer's test hook (a "crash" with the transaction left open, or a
failure after everything was committed). Concurrent attempts of one partition model speculation.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest

from reliable_kafka.errors import TransactionFenced
from reliable_kafka.spark import read_kafka, write_kafka
from reliable_kafka.spark.faults import fail_attempts
from reliable_kafka.spark.options import reader_options, writer_options
from reliable_kafka.spark.reader import read_range, resolve_ranges
from reliable_kafka.spark.writer import PartitionCommit, complete_write, prepare_write, write_partition
from reliable_kafka.testing.verify import verdict
from tests.spark.jobs import PARTITIONS, ROWS_PER_PARTITION, ids_by_value, numbered_frame, read_back

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

TOTAL = PARTITIONS * ROWS_PER_PARTITION
FAIL_AFTER = 700  # rows a failing first attempt writes before it fails
CHUNK = 500  # exactly_once chunk: the first chunk commits before the failure, the second is open


@pytest.mark.parametrize("fault", ["upstream_failure", "crash_with_open_transaction", "failure_after_commit"])
def test_exactly_once_first_attempts_fail_and_nothing_is_lost_or_duplicated(spark, kafka, make_topic, fault) -> None:
    topic = make_topic(partitions=3)
    write_id = f"eos-{uuid.uuid4().hex[:8]}"
    df, values = numbered_frame(spark, write_id)
    options = {"chunkRows": str(CHUNK)}
    if fault == "upstream_failure":
        df = fail_attempts(df, after_rows=FAIL_AFTER)
    else:
        options["test.failFirstAttemptAfterRows"] = str(FAIL_AFTER if fault == "crash_with_open_transaction" else -1)

    result = write_kafka(df, kafka.bootstrap_servers, topic, guarantee="exactly_once", write_id=write_id,
                         num_partitions=PARTITIONS, options=options)

    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (TOTAL, 0, 0), v
    manifest = result.manifest
    assert manifest is not None and manifest.rows == TOTAL
    # Every partition failed once and was completed by a later attempt (upstream, the first attempt's
    # writer can outlive its task and fence the second, so a third may finish the partition) ...
    attempts = {m.attempt for m in manifest.partitions.values()}
    if fault == "upstream_failure":
        assert min(attempts) >= 1
    else:
        assert attempts == {1}
    # ... which found the partition complete, or resumed after the first attempt's committed chunk
    # (upstream, the failure races with that commit: the chunk may or may not have made it).
    written = {manifest.partitions[p].rows_written for p in range(PARTITIONS)}
    if fault == "failure_after_commit":
        assert written == {0}
    elif fault == "crash_with_open_transaction":
        assert written == {ROWS_PER_PARTITION - CHUNK}
    else:
        assert written <= {ROWS_PER_PARTITION - CHUNK, ROWS_PER_PARTITION}
    if fault == "crash_with_open_transaction":
        # The fault bit: the crashed attempts' rows are in the log, aborted by the retry's fencing.
        raw = read_back(kafka.bootstrap_servers, topic, isolation_level="read_uncommitted")
        assert len(raw) == TOTAL + PARTITIONS * (FAIL_AFTER - CHUNK)


@pytest.mark.parametrize("fault", ["upstream_failure", "failure_after_delivery"])
def test_at_least_once_retries_lose_nothing_and_copies_share_their_rk_id(spark, kafka_connector, kafka, make_topic,
                                                                        fault) -> None:
    """Upstream failures through Spark's own sink (write_path="auto" takes it), the failure after delivery
    (injected in the Python writer) through format("reliable_kafka")."""
    topic = make_topic(partitions=3)
    write_id = f"alo-{uuid.uuid4().hex[:8]}"
    df, values = numbered_frame(spark, write_id)
    options = {}
    if fault == "upstream_failure":
        df = fail_attempts(df, after_rows=FAIL_AFTER)
    else:
        options["test.failFirstAttemptAfterRows"] = "-1"

    result = write_kafka(df, kafka.bootstrap_servers, topic, guarantee="at_least_once", write_id=write_id,
                         options=options)
    assert result.path == ("jvm" if fault == "upstream_failure" else "python")

    messages = read_back(kafka.bootstrap_servers, topic)
    v = verdict(values, [m.value() for m in messages])
    assert (v.acked, v.lost) == (TOTAL, 0), v
    if fault == "failure_after_delivery":
        assert v.duplicates == TOTAL, "every row was delivered, then its task failed and was retried"
    ids = ids_by_value(messages)
    assert all(len(found) == 1 and None not in found for found in ids.values()), "a copy got a different rk-id"
    assert len({next(iter(found)) for found in ids.values()}) == TOTAL

    deduped = read_kafka(spark, kafka.bootstrap_servers, subscribe=topic, dedup_by_rk_id=True)
    got = [r.value for r in deduped.df.select("value").collect()]
    d = verdict(values, got)
    assert (d.consumed, d.lost, d.duplicates) == (TOTAL, 0, 0), d


def test_control_spark_kafka_sink_duplicates_in_the_same_failing_job(spark, kafka_connector, kafka, make_topic) -> None:
    topic = make_topic(partitions=3)
    tag = f"ctl-{uuid.uuid4().hex[:8]}"
    df, values = numbered_frame(spark, tag)
    failing = fail_attempts(df, after_rows=FAIL_AFTER)

    failing.write.format("kafka").option("kafka.bootstrap.servers", kafka.bootstrap_servers).option(
        "topic", topic
    ).mode("append").save()

    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert v.lost == 0
    assert v.duplicates > 0, "Spark's own sink re-sends what a failed attempt already wrote"


# ---- speculation: two attempts of one partition at the same time ------------------------------------


def _batches(values: list[bytes], size: int = 100) -> list[pa.RecordBatch]:
    return [pa.record_batch([pa.array(values[i : i + size], pa.binary())], names=["value"])
            for i in range(0, len(values), size)]


def _race(options, batches: list[pa.RecordBatch], copy: Iterator[pa.RecordBatch] | None = None) -> dict[int, object]:
    """Attempt 0 writes half its rows and stalls; attempt 1 (the speculative copy) runs to its end (`copy`:
    its input, by default the same rows); then attempt 0 goes on. Returns each attempt's PartitionCommit or
    exception."""
    stalled, resume = threading.Event(), threading.Event()
    results: dict[int, object] = {}

    def slow() -> Iterator[pa.RecordBatch]:
        for i, batch in enumerate(batches):
            if i == len(batches) // 2:
                stalled.set()
                resume.wait(60)
            yield batch

    def run(attempt: int, source) -> None:
        try:
            results[attempt] = write_partition(options, source, partition=0, attempt=attempt)
        except Exception as exc:  # the outcome under test
            results[attempt] = exc

    first = threading.Thread(target=run, args=(0, slow()))
    first.start()
    assert stalled.wait(60)
    run(1, copy if copy is not None else iter(batches))
    resume.set()
    first.join(90)
    assert not first.is_alive()
    return results


def _exactly_once_options(kafka, topic: str, write_id: str, **extra: str):
    return writer_options({
        "kafka.bootstrap.servers": kafka.bootstrap_servers, "topic": topic, "guarantee": "exactly_once",
        "write_id": write_id, "chunkRows": "300", "numPartitions": "1", **extra,
    })


def test_concurrent_attempts_exactly_once_the_older_is_fenced_and_ends_with_the_copys_outcome(
        kafka, make_topic) -> None:
    topic = make_topic(partitions=2)
    write_id = f"spec-{uuid.uuid4().hex[:8]}"
    values = [f"{write_id}-{i:05d}".encode() for i in range(1_000)]
    options = _exactly_once_options(kafka, topic, write_id)
    assert prepare_write(options) is None

    results = _race(options, _batches(values))

    assert isinstance(results[1], PartitionCommit), results[1]
    assert results[1].resumed_from == 300, "the copy resumed after the chunk the stalled attempt committed"
    # The fenced attempt does not fail (Spark would count that against spark.task.maxFailures): it ends
    # with the copy's outcome, having checked that its own input is the same.
    # The fence bit: the older attempt wrote only its first chunk (rows_written counts what it committed);
    # the rows it sent after the copy's init_transactions were refused, and it ended on the copy's chunks.
    older = results[0]
    assert isinstance(older, PartitionCommit), older
    assert (older.attempt, older.rows, older.rows_written, older.fingerprint, older.chunks) == (
        0, 1_000, 300, results[1].fingerprint, results[1].chunks)
    complete_write(options, [older], None)  # Spark may keep either success: the older one's is as good
    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (1_000, 0, 0), v


def test_a_fenced_attempt_whose_copy_died_gives_up_with_the_fence_and_a_retry_finishes(kafka, make_topic) -> None:
    topic = make_topic(partitions=2)
    write_id = f"spec-{uuid.uuid4().hex[:8]}"
    values = [f"{write_id}-{i:05d}".encode() for i in range(1_000)]
    # The shortest transaction timeout: how long a fenced attempt waits for a marker that stopped moving.
    options = _exactly_once_options(kafka, topic, write_id, transactionTimeoutMs="10000", chunkSeconds="3")
    assert prepare_write(options) is None
    batches = _batches(values)

    def dies_after_a_chunk() -> Iterator[pa.RecordBatch]:
        yield from batches[:7]  # one 300-row chunk past the 300 the stalled attempt committed
        raise RuntimeError("the copy's executor was lost")

    results = _race(options, batches, copy=dies_after_a_chunk())

    assert isinstance(results[1], RuntimeError), results[1]
    # The fenced attempt waited for an outcome that never came (the marker stood still at the copy's
    # chunk), then failed with the fence: Spark's retry of the task takes over.
    assert isinstance(results[0], TransactionFenced), results[0]
    retry = write_partition(options, iter(batches), partition=0, attempt=2)
    assert retry.resumed_from == 600, retry
    complete_write(options, [retry], None)
    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (1_000, 0, 0), v


def test_concurrent_attempts_at_least_once_copies_share_rk_ids_and_dedup_drops_them(kafka, make_topic) -> None:
    topic = make_topic(partitions=2)
    write_id = f"spec-{uuid.uuid4().hex[:8]}"
    values = [f"{write_id}-{i:05d}".encode() for i in range(1_000)]
    options = writer_options({
        "kafka.bootstrap.servers": kafka.bootstrap_servers, "topic": topic, "guarantee": "at_least_once",
        "write_id": write_id,
    })

    results = _race(options, _batches(values))

    assert all(isinstance(r, PartitionCommit) for r in results.values()), results
    messages = read_back(kafka.bootstrap_servers, topic)
    v = verdict(values, [m.value() for m in messages])
    assert (v.lost, v.duplicates) == (0, 1_000)
    assert all(len(found) == 1 for found in ids_by_value(messages).values())
    reader = reader_options({"kafka.bootstrap.servers": kafka.bootstrap_servers, "subscribe": topic,
                             "dedupByRkId": "true"})
    got = [v for r in resolve_ranges(reader) for batch in read_range(reader, r)
           for v in batch.column("value").to_pylist()]
    d = verdict(values, got)
    assert (d.consumed, d.lost, d.duplicates) == (1_000, 0, 0), d
