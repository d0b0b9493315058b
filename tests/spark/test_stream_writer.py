"""writeStream.format("reliable_kafka"): micro-batches written exactly once across task failures and a replay
after a driver crash; at_least_once (the control) duplicates the replayed batch with the same rk-ids.

The source is a directory of text files read two files per micro-batch with trigger(availableNow=True): the
file source's log pins each batch's files, so a replayed batch reads the same rows into the same partitions.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from reliable_kafka.errors import ConfigError, WriteRefused
from reliable_kafka.spark import read_kafka, register
from reliable_kafka.spark.api import read_manifest
from reliable_kafka.spark.markers import COMPACTION_CONFIGS, Manifest, decode, manifest_key, partition_key
from reliable_kafka.spark.options import writer_options
from reliable_kafka.spark.source import ReliableKafkaDataSource
from reliable_kafka.spark.stream_writer import batch_write_id, transaction_scope
from reliable_kafka.spark.writer import write_partition
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


def _marker_history(bootstrap: str, marker_topic: str, query_id: str) -> dict[str, list[bytes | None]]:
    """Every value each marker-topic key of the query's batches took, in log order (None: a tombstone),
    read by an independent read_committed consumer."""
    history: dict[str, list[bytes | None]] = defaultdict(list)
    for m in read_back(bootstrap, marker_topic):
        key = m.key().decode()
        if key.startswith(f"{query_id}-"):
            history[key].append(m.value())
    return history


def _batch_keys(query_id: str, batch: int) -> list[str]:
    write_id = batch_write_id(query_id, batch)
    return [partition_key(write_id, p) for p in range(FILES_PER_BATCH)] + [manifest_key(write_id)]


def _assert_only_the_last_batch_is_live(history: dict[str, list[bytes | None]], query_id: str) -> None:
    """The commit of each batch tombstoned the previous batch's markers and manifest; the last batch's stay,
    for a replay of it. The stream wrote no other keys (no plan)."""
    expected = {key for batch in range(BATCHES) for key in _batch_keys(query_id, batch)}
    assert set(history) == expected, sorted(set(history) ^ expected)
    for batch in range(BATCHES):
        latest = {key: history[key][-1] for key in _batch_keys(query_id, batch)}
        if batch < BATCHES - 1:
            assert all(value is None for value in latest.values()), (batch, latest)
        else:
            assert all(value is not None for value in latest.values()), (batch, latest)


def test_exactly_once_stream_task_failures_every_batch_nothing_lost_or_duplicated(
        spark, kafka, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=3)
    # A marker topic of its own, created by the sink: its records are this query's only, and its
    # creation settings are the writer's.
    marker_topic = f"markers-{uuid.uuid4().hex[:8]}"
    src, values = _source(tmp_path, f"seos-{uuid.uuid4().hex[:8]}")

    # Every task's first attempt writes 150 rows (one 100-row chunk committed), then "crashes" with its
    # second chunk's transaction open; the retry fences it and resumes after the committed chunk.
    query = _run_stream(spark, src, tmp_path / "cp", kafka.bootstrap_servers, topic, "exactly_once",
                        chunkRows="100", markerTopic=marker_topic, markerTopicPartitions="4",
                        **{"test.failFirstAttemptAfterRows": "150"})
    query_id = str(query.id)

    # A stale attempt of batch 0 (a worker that outlived its task), after batch 1 released the batch:
    # no marker to resume from, only its tombstone, so it is refused and writes nothing.
    stale = writer_options({"kafka.bootstrap.servers": kafka.bootstrap_servers, "topic": topic,
                            "guarantee": "exactly_once", "write_id": batch_write_id(query_id, 0),
                            "markerTopic": marker_topic})
    rows = [pa.record_batch([pa.array(values[:ROWS_PER_FILE])], names=["value"])]
    with pytest.raises(WriteRefused, match="released"):
        write_partition(stale, rows, partition=0, attempt=2, transaction_scope=transaction_scope(query_id))

    v = verdict(values, [m.value() for m in read_back(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (TOTAL, 0, 0), v
    # The fault bit: every crashed attempt's 50 uncommitted rows are in the log, aborted.
    raw = read_back(kafka.bootstrap_servers, topic, isolation_level="read_uncommitted")
    assert len(raw) == TOTAL + BATCHES * FILES_PER_BATCH * 50

    history = _marker_history(kafka.bootstrap_servers, marker_topic, query_id)
    _assert_only_the_last_batch_is_live(history, query_id)
    # Each batch was written under its own write id (the query id and batch id the tasks read from
    # Spark's local properties), completed by the second attempt of every partition: the manifest as
    # the batch's commit wrote it, before the next batch released it.
    for batch in range(BATCHES):
        written = [value for value in history[manifest_key(batch_write_id(query_id, batch))] if value is not None]
        manifest = decode(written[-1])
        assert isinstance(manifest, Manifest) and manifest.rows == BATCH_ROWS, (batch, manifest)
        assert {m.attempt for m in manifest.partitions.values()} == {1}
        assert {m.rows_written for m in manifest.partitions.values()} == {ROWS_PER_FILE - 100}

    # The sink created the marker topic with the settings that let compaction remove released records.
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    resource = ConfigResource(ConfigResource.Type.TOPIC, marker_topic)
    configs = admin.describe_configs([resource])[resource].result(timeout=30)
    assert {name: configs[name].value for name in COMPACTION_CONFIGS} == COMPACTION_CONFIGS
    assert configs["cleanup.policy"].value == "compact"


@pytest.mark.parametrize("guarantee", ["exactly_once", "at_least_once"])
def test_batch_replayed_after_a_driver_crash_is_written_once(spark, kafka, make_topic, tmp_path, guarantee) -> None:
    topic = make_topic(partitions=3)
    marker_topic = f"markers-{uuid.uuid4().hex[:8]}"
    src, values = _source(tmp_path, f"srep-{uuid.uuid4().hex[:8]}")
    checkpoint = tmp_path / "cp"
    first = _run_stream(spark, src, checkpoint, kafka.bootstrap_servers, topic, guarantee,
                        markerTopic=marker_topic, markerTopicPartitions="4")
    last = BATCHES - 1
    assert (checkpoint / "commits" / str(last)).exists()

    # The driver "crashed" after the tasks of the last batch committed their output and before Spark
    # recorded the batch in its commit log: the offsets log still names the batch, so the restarted
    # query runs it again with the same input.
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    again = _run_stream(spark, src, checkpoint, kafka.bootstrap_servers, topic, guarantee,
                        markerTopic=marker_topic, markerTopicPartitions="4")

    assert again.id == first.id, "the query id lives in the checkpoint"
    replayed = [p for p in again.recentProgress if p["batchId"] == last and p["numInputRows"] > 0]
    assert [p["numInputRows"] for p in replayed] == [BATCH_ROWS], "the restart replayed the last batch"
    messages = read_back(kafka.bootstrap_servers, topic)
    v = verdict(values, [m.value() for m in messages])
    if guarantee == "exactly_once":
        assert (v.acked, v.lost, v.duplicates) == (TOTAL, 0, 0), v
        manifest = read_manifest(kafka.bootstrap_servers, batch_write_id(str(first.id), last), marker_topic)
        assert manifest is not None and manifest.rows == BATCH_ROWS and manifest.rows_written == 0
        # The first run's commit of the last batch had released the batches before it; the replay found
        # the last batch's markers live (it resumed from them) and left them live.
        _assert_only_the_last_batch_is_live(
            _marker_history(kafka.bootstrap_servers, marker_topic, str(first.id)), str(first.id))
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
