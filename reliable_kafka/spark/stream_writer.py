"""The Structured Streaming sink: each micro-batch is one write of the batch writer's core (writer.py).

A micro-batch's write id is derived from the query id (kept in the checkpoint, the same after a restart)
and the batch id, so a batch Spark replays after a task retry or a driver crash has the same write id:
exactly_once skips what its markers say is committed and writes the rest once; at_least_once re-sends
with the same rk-ids, which a dedup by rk-id drops.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping

import pyarrow as pa
from confluent_kafka import KafkaException
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage

from reliable_kafka.errors import ConfigError, PartitionWriteFailed, ReliableKafkaError
from reliable_kafka.spark.markers import MarkerTopic
from reliable_kafka.spark.options import EXACTLY_ONCE, WriterOptions, writer_options
from reliable_kafka.spark.writer import PartitionCommit, complete_write, current_task, write_partition

log = logging.getLogger(__name__)

# Task local properties Spark's micro-batch engine sets for every task of a batch
# (StreamExecution.QUERY_ID_KEY and MicroBatchExecution.BATCH_ID_KEY in Spark 4.x). The query id is
# stored in the checkpoint's metadata file and survives restarts; the run id (sql.streaming.runId)
# changes with every start, so it must never be part of a write id.
QUERY_ID_KEY = "sql.streaming.queryId"
BATCH_ID_KEY = "streaming.sql.batchId"

# Names a stream's sink is handed besides the writer's own.
STREAM_WRITER_OPTIONS = frozenset({"checkpointLocation"})

# The write id a stream's options are validated with before any batch has one of its own.
_UNBOUND = "stream"


def batch_write_id(query_id: str, batch_id: int) -> str:
    """The write id of one micro-batch: markers, the manifest and rk-ids of its rows are keyed by it."""
    return f"{query_id}-{batch_id}"


def previous_batch_write_id(write_id: str, batch_id: int) -> str | None:
    """The write id of the micro-batch before `batch_id` of the query `write_id` belongs to (None for the first).

    Spark numbers a query's micro-batches 0, 1, 2, ... without gaps, also across restarts from its checkpoint.
    None too when `write_id` is not batch `batch_id`'s (nothing is then known about its query).
    """
    suffix = f"-{batch_id}"
    if batch_id <= 0 or not write_id.endswith(suffix):
        return None
    return batch_write_id(write_id[: -len(suffix)], batch_id - 1)


def transaction_scope(query_id: str) -> str:
    """The exactly_once transactional.id scope of a query: one id per (query, Spark partition)."""
    return f"stream-{query_id}"


def stream_writer_options(options: Mapping[str, str]) -> WriterOptions:
    """The batch writer's options for a stream; a fixed write id is refused (each batch derives its own)."""
    for name in ("write_id", "writeId"):
        if any(key.lower() == name.lower() for key in options):
            raise ConfigError(
                name, "a stream derives one write id per micro-batch from its query id and batch id; remove it "
                "(the checkpointLocation is what keeps the ids stable across restarts)")
    # Spark hands the sink the query's own options too (its checkpointLocation).
    return writer_options({**options, "write_id": _UNBOUND}, extra_names=STREAM_WRITER_OPTIONS)


class KafkaStreamArrowWriter(DataSourceStreamArrowWriter):
    """The DataSourceStreamArrowWriter Spark runs for every micro-batch: one PartitionCommit per task."""

    def __init__(self, options: WriterOptions) -> None:
        self.options = options
        if options.guarantee == EXACTLY_ONCE:
            # Before any task: the tasks' transactions write their markers into this topic.
            MarkerTopic(options.kafka, options.marker_topic).ensure(options.marker_topic_partitions)

    def for_batch(self, query_id: str, batch_id: int) -> WriterOptions:
        """The options of one micro-batch: the write id becomes the batch's own."""
        return dataclasses.replace(self.options, write_id=batch_write_id(query_id, batch_id))

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionCommit:
        context = current_task()
        query_id = context.getLocalProperty(QUERY_ID_KEY)
        batch_id = context.getLocalProperty(BATCH_ID_KEY)
        if not query_id or batch_id is None:
            raise PartitionWriteFailed(
                f"the task has no {QUERY_ID_KEY!r}/{BATCH_ID_KEY!r} local properties: this writer runs only in "
                "a micro-batch streaming query (continuous trigger is not supported)")
        return write_partition(
            self.for_batch(query_id, int(batch_id)), iterator, partition=context.partitionId(),
            attempt=context.attemptNumber(),
            transaction_scope=transaction_scope(query_id) if self.options.guarantee == EXACTLY_ONCE else None,
        )

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        commits = [m if isinstance(m, PartitionCommit) else None for m in messages]
        done = [c for c in commits if c is not None]
        if not done:
            log.info("stream batch %d had no partitions to write", batchId)
            return
        # The driver's commit runner is not told the query id; every task reported its write id.
        write_ids = {c.write_id for c in done}
        if len(write_ids) != 1:
            raise PartitionWriteFailed(f"batch {batchId}: the tasks reported different write ids {sorted(write_ids)}")
        options = dataclasses.replace(self.options, write_id=write_ids.pop())
        if self.options.guarantee == EXACTLY_ONCE:
            # The batch's manifest: an audit record of what every partition committed. A batch replayed
            # after a driver crash finds its partitions committed and writes the same manifest again.
            complete_write(options, commits, None)
            self.release_previous(options.write_id, batchId)
        else:
            log.info("stream write %s (at_least_once) delivered %d rows in %d partitions", options.write_id,
                     sum(c.rows for c in done), len(commits))

    def release_previous(self, write_id: str, batch_id: int) -> None:
        """Tombstone the markers, plan and manifest of the query's previous micro-batch.

        Spark runs batch N only once batch N-1 is in the checkpoint's commit log, and after a driver crash
        it replays only the last batch of the offsets log, so once batch N is running batch N-1 never runs
        again: its records are no longer needed, and without this every micro-batch would leave keys that
        compaction never removes. Batch N's own stay until N+1 commits (a replay of N needs them).
        Nothing is released when batch N-1 has no manifest: already released (this is a replay of N after
        a driver crash), or written at_least_once (the query ran with it before a restart; the records of
        exactly_once batches before those then stay).
        """
        previous = previous_batch_write_id(write_id, batch_id)
        if previous is None:
            if batch_id > 0:
                log.warning("stream batch %d reported write id %r, not one of this batch: nothing released",
                            batch_id, write_id)
            return
        try:
            MarkerTopic(self.options.kafka, self.options.marker_topic).release(previous)
        except (KafkaException, ReliableKafkaError) as exc:
            # Housekeeping, not the batch's outcome (its rows and manifest are committed): failing the
            # query for it would only replay this batch. The previous batch's records stay in place.
            log.warning("stream batch %d: the records of write %s were not released (%s); they stay in the "
                        "marker topic", batch_id, previous, exc)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        finished = sum(isinstance(m, PartitionCommit) for m in messages)
        log.warning(
            "stream batch %d failed; %d partition(s) had finished. %s", batchId, finished,
            "Restart the query from the same checkpointLocation: Spark replays the batch and committed "
            "partitions and chunks are skipped." if self.options.guarantee == EXACTLY_ONCE
            else "at_least_once: the replay re-sends its rows with the same rk-ids.",
        )
