"""Re-running an exactly_once write id: a completed one writes nothing, a changed input is refused, and a
job that failed halfway is finished by writing only what is missing."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from reliable_kafka.errors import WriteRefused
from reliable_kafka.spark import write_kafka
from reliable_kafka.spark.faults import UntilCommitted, fail_attempts
from reliable_kafka.testing.verify import verdict
from tests.spark.jobs import PARTITIONS, ROWS_PER_PARTITION, numbered_frame, read_back

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

TOTAL = PARTITIONS * ROWS_PER_PARTITION


def _log_ends(bootstrap: str, topic: str, partitions: int = 3) -> list[int]:
    """High watermarks: any record written (committed, aborted or a transaction marker) moves them."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"rk-ends-{uuid.uuid4().hex}"})
    try:
        return [consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
                for p in range(partitions)]
    finally:
        consumer.close()


@dataclass(frozen=True)
class Completed:
    topic: str
    write_id: str
    df: Any
    values: list[bytes]
    manifest: Any
    ends: list[int]


@pytest.fixture(scope="module")
def completed(spark_session: Any, kafka_session: Any) -> Completed:
    """One completed exactly_once write, shared by the re-run tests of this module (none may write)."""
    topic = f"t-{uuid.uuid4().hex[:10]}"
    kafka_session.create_topic(topic, 3)
    write_id = f"rerun-{uuid.uuid4().hex[:8]}"
    df, values = numbered_frame(spark_session, write_id)
    result = write_kafka(df, kafka_session.bootstrap_servers, topic, guarantee="exactly_once", write_id=write_id,
                         num_partitions=PARTITIONS)
    return Completed(topic, write_id, df, values, result.manifest, _log_ends(kafka_session.bootstrap_servers, topic))


def test_rerun_of_a_completed_write_id_writes_nothing(kafka, completed: Completed) -> None:
    again = write_kafka(completed.df, kafka.bootstrap_servers, completed.topic, guarantee="exactly_once",
                        write_id=completed.write_id, num_partitions=PARTITIONS)

    assert _log_ends(kafka.bootstrap_servers, completed.topic) == completed.ends, "the re-run wrote to the topic"
    assert again.manifest == completed.manifest
    v = verdict(completed.values, [m.value() for m in read_back(kafka.bootstrap_servers, completed.topic)])
    assert (v.acked, v.lost, v.duplicates) == (TOTAL, 0, 0)


def test_changed_input_under_the_same_write_id_is_refused(spark, kafka, completed: Completed) -> None:
    from pyspark.sql import functions as F

    column = completed.df.columns[0]
    changed = {
        # One value of the last partition differs: only that partition's tasks can notice.
        "one value changed": completed.df.withColumn(
            column, F.when(F.col(column).isin([completed.values[-1]]), F.lit(b"other")).otherwise(F.col(column))
        ),
        "other partitioning": numbered_frame(spark, completed.write_id, partitions=PARTITIONS + 1,
                                             rows_per_partition=TOTAL // (PARTITIONS + 1))[0],
    }
    for what, frame in changed.items():
        with pytest.raises(WriteRefused, match="changed") as refused:
            write_kafka(frame, kafka.bootstrap_servers, completed.topic, guarantee="exactly_once",
                        write_id=completed.write_id)
        assert completed.write_id in str(refused.value), what
        assert _log_ends(kafka.bootstrap_servers, completed.topic) == completed.ends, f"{what}: a refused write wrote"


def test_rerun_after_a_failed_job_writes_only_what_is_missing(spark, kafka, make_topic) -> None:
    topic = make_topic(partitions=3)
    write_id = f"half-{uuid.uuid4().hex[:8]}"
    df, values = numbered_frame(spark, write_id, partitions=3)
    # Partition 2 fails on every attempt, and only once partitions 0 and 1 are complete: the job fails
    # with two of its three partitions written, deterministically.
    failing = fail_attempts(
        df, after_rows=0, attempts=None, partitions=(2,),
        before_failing=UntilCommitted(kafka.bootstrap_servers, write_id, (0, 1)),
    )
    with pytest.raises(Exception, match="injected failure"):
        write_kafka(failing, kafka.bootstrap_servers, topic, guarantee="exactly_once", write_id=write_id,
                    num_partitions=3)
    halfway = sorted(m.value() for m in read_back(kafka.bootstrap_servers, topic))
    assert halfway == values[: 2 * ROWS_PER_PARTITION], "partitions 0 and 1 committed, 2 nothing"

    result = write_kafka(df, kafka.bootstrap_servers, topic, guarantee="exactly_once", write_id=write_id,
                         num_partitions=3)

    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (len(values), 0, 0), v
    assert result.manifest is not None
    assert [result.manifest.partitions[p].rows_written for p in range(3)] == [0, 0, ROWS_PER_PARTITION]


def test_a_retry_resumes_only_the_same_prefix_and_a_completed_write_only_the_same_rows(kafka, make_topic) -> None:
    """Writer level (no Spark): attempts of one partition called directly, as Spark would run them."""
    import pyarrow as pa

    from reliable_kafka.spark.markers import Manifest
    from reliable_kafka.spark.options import writer_options
    from reliable_kafka.spark.writer import complete_write, prepare_write, write_partition

    topic = make_topic(partitions=1)
    write_id = f"prefix-{uuid.uuid4().hex[:8]}"
    values = [f"{write_id}-{i:04d}".encode() for i in range(500)]

    def batches(vals: list[bytes]) -> list[pa.RecordBatch]:
        return [pa.record_batch([pa.array(vals[i : i + 64], pa.binary())], names=["value"])
                for i in range(0, len(vals), 64)]

    options = writer_options({
        "kafka.bootstrap.servers": kafka.bootstrap_servers, "topic": topic, "guarantee": "exactly_once",
        "write_id": write_id, "chunkRows": "100", "numPartitions": "1", "test.failFirstAttemptAfterRows": "250",
    })
    assert prepare_write(options) is None
    with pytest.raises(RuntimeError, match="test hook"):
        write_partition(options, batches(values), partition=0, attempt=0)  # commits 200 rows, then "crashes"
    committed = sorted(m.value() for m in read_back(kafka.bootstrap_servers, topic))
    assert committed == values[:200]

    for what, other in {"changed prefix": [b"x", *values[1:]], "fewer rows": values[:150]}.items():
        with pytest.raises(WriteRefused, match="changed since an earlier attempt"):
            write_partition(options, batches(other), partition=0, attempt=1)
        assert sorted(m.value() for m in read_back(kafka.bootstrap_servers, topic)) == committed, what

    done = write_partition(options, batches(values), partition=0, attempt=2)
    assert (done.resumed_from, done.rows_written, done.rows) == (200, 300, 500)
    manifest = complete_write(options, [done], None)
    assert isinstance(manifest, Manifest) and manifest.rows == 500
    with pytest.raises(WriteRefused, match="changed since the write completed"):
        write_partition(options, batches([*values, b"one more"]), partition=0, attempt=0, manifest=manifest)
    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (500, 0, 0)
