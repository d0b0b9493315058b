"""writeStream.format("reliable_kafka"): micro-batches written exactly once across task failures and a replay
after a driver crash; at_least_once (the control) duplicates the replayed batch with the same rk-ids.

The source is a directory of text files read two files per micro-batch with trigger(availableNow=True): the
file source's log pins each batch's files, so a replayed batch reads the same rows into the same partitions.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from reliable_kafka.errors import ConfigError
from reliable_kafka.spark import read_kafka, register
from reliable_kafka.spark.api import read_manifest
from reliable_kafka.spark.source import ReliableKafkaDataSource
from reliable_kafka.spark.stream_writer import batch_write_id
from reliable_kafka.testing.verify import verdict
from tests.spark.jobs import ids_by_value, read_back

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

FILES = 6
FILES_PER_BATCH = 2  # one Spark partition per (small) file: 3 micro-batches of 2 partitions
ROWS_PER_FILE = 400
TOTAL = FILES * ROWS_PER_FILE
BATCHES = FILES // FILES_PER_BATCH
BATCH_ROWS = FILES_PER_BATCH * ROWS_PER_FILE


def _source(root: Path, tag: str) -> tuple[Path, list[bytes]]:
    """FILES text files of unique lines; the values every micro-batch together must write once."""
    src = root / "in"
    src.mkdir()
    values: list[bytes] = []
    for f in range(FILES):
        lines = [f"{tag}-{f:02d}-{i:05d}" for i in range(ROWS_PER_FILE)]
        (src / f"part-{f:02d}.txt").write_text("\n".join(lines) + "\n")
        values += [line.encode() for line in lines]
    return src, values


def _run_stream(spark: Any, src: Path, checkpoint: Path, bootstrap: str, topic: str, guarantee: str,
                **options: str) -> Any:
    """Run the query until the source has no more files; returns the finished StreamingQuery."""
    register(spark)
    df = spark.readStream.format("text").option("maxFilesPerTrigger", FILES_PER_BATCH).load(str(src))
    query = (
        df.writeStream.format("reliable_kafka")
        .option("kafka.bootstrap.servers", bootstrap).option("topic", topic).option("guarantee", guarantee)
        .option("checkpointLocation", str(checkpoint)).options(**options)
        .trigger(availableNow=True).start()
    )
    try:
        assert query.awaitTermination(120), "the stream did not finish its files in time"
    finally:
        query.stop()
    assert query.exception() is None, query.exception()
    return query


def test_exactly_once_stream_task_failures_every_batch_nothing_lost_or_duplicated(
        spark, kafka, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=3)
    src, values = _source(tmp_path, f"seos-{uuid.uuid4().hex[:8]}")

    # Every task's first attempt writes 150 rows (one 100-row chunk committed), then "crashes" with its
    # second chunk's transaction open; the retry fences it and resumes after the committed chunk.
    query = _run_stream(spark, src, tmp_path / "cp", kafka.bootstrap_servers, topic, "exactly_once",
                        chunkRows="100", **{"test.failFirstAttemptAfterRows": "150"})

    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (TOTAL, 0, 0), v
    # The fault bit: every crashed attempt's 50 uncommitted rows are in the log, aborted.
    raw = read_back(kafka.bootstrap_servers, topic, isolation_level="read_uncommitted")
    assert len(raw) == TOTAL + BATCHES * FILES_PER_BATCH * 50
    # Each batch was written under its own write id (the query id and batch id the tasks read from
    # Spark's local properties), completed by the second attempt of every partition.
    for batch in range(BATCHES):
        manifest = read_manifest(kafka.bootstrap_servers, batch_write_id(str(query.id), batch))
        assert manifest is not None and manifest.rows == BATCH_ROWS, (batch, manifest)
        assert {m.attempt for m in manifest.partitions.values()} == {1}
        assert {m.rows_written for m in manifest.partitions.values()} == {ROWS_PER_FILE - 100}


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
def test_batch_replayed_after_a_driver_crash_is_written_once(spark, kafka, make_topic, tmp_path, guarantee) -> None:
    topic = make_topic(partitions=3)
    src, values = _source(tmp_path, f"srep-{uuid.uuid4().hex[:8]}")
    checkpoint = tmp_path / "cp"
    first = _run_stream(spark, src, checkpoint, kafka.bootstrap_servers, topic, guarantee)
    last = BATCHES - 1
    assert (checkpoint / "commits" / str(last)).exists()

    # The driver "crashed" after the tasks of the last batch committed their output and before Spark
    # recorded the batch in its commit log: the offsets log still names the batch, so the restarted
    # query runs it again with the same input.
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    again = _run_stream(spark, src, checkpoint, kafka.bootstrap_servers, topic, guarantee)

    assert again.id == first.id, "the query id lives in the checkpoint"
    replayed = [p for p in again.recentProgress if p["batchId"] == last and p["numInputRows"] > 0]
    assert [p["numInputRows"] for p in replayed] == [BATCH_ROWS], "the restart replayed the last batch"
    messages = read_back(kafka.bootstrap_servers, topic)
    v = verdict(values, [m.value() for m in messages])
    if guarantee == "exactly_once":
        assert (v.acked, v.lost, v.duplicates) == (TOTAL, 0, 0), v
        manifest = read_manifest(kafka.bootstrap_servers, batch_write_id(str(first.id), last))
        assert manifest is not None and manifest.rows == BATCH_ROWS and manifest.rows_written == 0
        return
    # The control: at_least_once writes the replayed batch again ...
    assert (v.lost, v.duplicates) == (0, BATCH_ROWS), v
    # ... with the rk-ids of the first copies (query id, batch id, partition, row), so dedup drops them.
    ids = ids_by_value(messages)
    assert all(len(found) == 1 and None not in found for found in ids.values()), "a copy got a different rk-id"
    deduped = read_kafka(spark, kafka.bootstrap_servers, subscribe=topic, dedup_by_rk_id=True)
    d = verdict(values, [r.value for r in deduped.df.select("value").collect()])
    assert (d.consumed, d.lost, d.duplicates) == (TOTAL, 0, 0), d


def test_a_fixed_write_id_is_refused_for_a_stream() -> None:
    source = ReliableKafkaDataSource({"kafka.bootstrap.servers": "localhost:9", "topic": "t",
                                      "guarantee": "exactly_once", "write_id": "w1"})
    from pyspark.sql.types import StringType, StructType

    with pytest.raises(ConfigError, match="write_id"):
        source.streamWriter(StructType().add("value", StringType()), False)
