"""The Spark streaming read path: micro-batches of read_committed offset ranges, their offsets in Spark's checkpoint.

Every micro-batch reads each partition from where the previous one ended up to at most the last stable
offset, so no record of an open or aborted transaction is returned and no committed one is skipped or
read twice, also across restarts (the offsets are in the checkpoint, as {"topic": {"0": 123}}). Records
the log no longer holds fail the query (failOnDataLoss=true) or are skipped with a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from reliable_kafka.config import connection_settings
from reliable_kafka.errors import CommitFailed, ReadIncomplete
from reliable_kafka.spark.options import StreamReaderOptions
from reliable_kafka.spark.reader import (
    OffsetRange,
    _list_offsets,
    commit_group_offsets,
    log_bounds,
    offset_dict,
    offset_map,
    read_range,
    starting_offsets,
)

log = logging.getLogger(__name__)

Offsets = dict[tuple[str, int], int]

# librdkafka's names for "the offset asked for is not in the log" (see reader._raise_unless_transient).
_OFFSET_GONE = ("_AUTO_OFFSET_RESET", "OFFSET_OUT_OF_RANGE")


def fair_shares(available: Mapping[tuple[str, int], int], limit: int) -> Offsets:
    """Split `limit` offsets over partitions with `available` offsets each, max-min fair.

    Every partition gets an equal share, and what a partition cannot use (it has fewer offsets left)
    goes to the others, so the shares add up to min(limit, total available) and a busy partition cannot
    starve a quiet one. Deterministic: the same input always gives the same shares.
    """
    shares = {key: 0 for key in available}
    remaining = limit
    pending = sorted(key for key, n in available.items() if n > 0)
    while pending and remaining > 0:
        each = remaining // len(pending)
        if each == 0:
            # Fewer offsets left than partitions wanting them: one each, in partition order.
            for key in pending[:remaining]:
                shares[key] += 1
            break
        still = []
        for key in pending:
            give = min(each, available[key] - shares[key])
            shares[key] += give
            remaining -= give
            if shares[key] < available[key]:
                still.append(key)
        pending = still
    return shares


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The DataSourceStreamReader Spark runs: offsets planned on the driver, ranges read in tasks by read_range."""

    def __init__(self, options: StreamReaderOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self._admin: AdminClient | None = None
        # Trigger.AvailableNow: the last stable offsets when the query started; it reads no further.
        self._stop_at: Offsets | None = None
        self._latest: Offsets | None = None
        self._group_offsets: Offsets | None = None  # what commitGroupOffsets last committed

    def __getstate__(self) -> dict[str, Any]:
        # Spark pickles the reader into its tasks; a Kafka client cannot travel, a task makes its own.
        return {**self.__dict__, "_admin": None}

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient(connection_settings(self.options.reader.kafka))
        return self._admin

    # ---- planning (driver) ----------------------------------------------------------------------

    def initialOffset(self) -> dict:
        earliest, latest = log_bounds(self.options.reader, self._admin_client())
        return offset_dict(starting_offsets(self.options.reader, earliest, latest))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.options.max_offsets_per_trigger
        return ReadMaxRows(n) if n is not None else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._stop_at = log_bounds(self.options.reader, self._admin_client())[1]

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        # Spark asks for the next batch's end only once the previous batch is done: `start` is what
        # the query has processed. Its commit() comes later (when a next batch is planned, so never
        # while the topic is quiet), so the group's offsets are moved here too.
        self._commit_group(offset_map(start))
        earliest, latest = log_bounds(self.options.reader, self._admin_client())
        self._latest = latest
        begin = {}
        for key, offset in offset_map(start).items():
            if key not in earliest:
                self._data_loss(key, f"the partition no longer exists; the query had read it up to offset {offset}")
            else:
                begin[key] = self._start_within(key, offset, earliest[key], latest[key])
        for key in earliest.keys() - begin.keys():
            # A partition the query has not seen yet (added to a topic, or a new topic matching
            # subscribePattern) is read from its beginning: everything in it is new to the query.
            log.info("%s[%d]: new partition, reading it from offset %d", *key, earliest[key])
            begin[key] = earliest[key]
        if self._stop_at is not None:
            # Partitions that appeared after an AvailableNow query started wait for its next run.
            begin = {key: offset for key, offset in begin.items() if key in self._stop_at}
            latest = {key: min(offset, self._stop_at[key]) for key, offset in latest.items() if key in self._stop_at}
        # max(0, ...): the start may be past the AvailableNow cap (a partition with nothing to read).
        available = {key: max(0, latest[key] - offset) for key, offset in begin.items()}
        if isinstance(limit, ReadMaxRows):
            # The limit counts offsets, as Spark's maxOffsetsPerTrigger does: transaction markers and
            # aborted records take offsets too, so a micro-batch holds at most that many rows.
            available = fair_shares(available, limit.max_rows)
        return offset_dict({key: offset + available[key] for key, offset in begin.items()})

    def reportLatestOffset(self) -> dict | None:
        return offset_dict(self._latest) if self._latest is not None else None

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        ends = offset_map(end)
        starts = offset_map(start)
        earliest = _list_offsets(self._admin_client(), [TopicPartition(t, p) for t, p in ends], OffsetSpec.earliest())
        ranges: list[InputPartition] = []
        for key, stop in sorted(ends.items()):
            first = starts.get(key)
            # A partition new in this micro-batch starts where latestOffset started it: at its beginning.
            begin = earliest[key] if first is None else self._start_within(key, first, earliest[key], stop)
            if begin < stop:
                ranges.append(OffsetRange(key[0], key[1], begin, stop))
        return ranges

    def _start_within(self, key: tuple[str, int], offset: int, earliest: int, end: int) -> int:
        """Where reading `key` continues from `offset`, given the log now holds [earliest, end)."""
        if offset < earliest:
            self._data_loss(key, f"offsets {offset} to {earliest - 1} were deleted (retention or truncation) "
                                  "before the query read them")
            return earliest
        if offset > end:
            self._data_loss(key, f"the query had read up to offset {offset} but the log now ends at {end}: "
                                  "was the topic deleted and recreated?")
            return earliest
        return offset

    def _data_loss(self, key: tuple[str, int], what: str) -> None:
        topic, partition = key
        if self.options.fail_on_data_loss:
            raise ReadIncomplete(
                f"{topic}[{partition}]: {what}. Records the query never read are gone; set failOnDataLoss=false "
                "to skip them and go on (with a warning)",
                topic=topic, partition=partition,
            )
        log.warning("%s[%d]: %s; skipping ahead (failOnDataLoss=false)", topic, partition, what)

    def commit(self, end: dict) -> None:
        self._commit_group(offset_map(end))

    def _commit_group(self, offsets: Offsets) -> None:
        """commitGroupOffsets: record processed offsets for kafka.group.id, once per change."""
        if not self.options.commit_group_offsets or offsets == self._group_offsets:
            return
        group = self.options.reader.group_id
        assert group is not None  # stream_reader_options requires kafka.group.id with commitGroupOffsets
        try:
            commit_group_offsets(self.options.reader.kafka, group, offsets)
            self._group_offsets = offsets
        except CommitFailed as exc:
            # The checkpoint, not the group, is where the query resumes from: a failed commit only
            # leaves the group's lag stale until the next micro-batch commits again.
            log.warning("commitGroupOffsets: %s; the query goes on (its checkpoint holds its offsets)", exc)

    def stop(self) -> None:
        self._admin = None

    # ---- reading (tasks) --------------------------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, OffsetRange)
        r = partition
        if not self.options.fail_on_data_loss:
            # Retention may have deleted the range's start since it was planned: skip what is gone.
            # (A deletion while the task reads fails the attempt; Spark's retry starts here again.)
            earliest = _list_offsets(self._admin_client(), [TopicPartition(r.topic, r.partition)],
                                     OffsetSpec.earliest())[(r.topic, r.partition)]
            if earliest > r.start:
                log.warning("%s[%d]: offsets %d to %d were deleted before this task read them; skipping "
                            "them (failOnDataLoss=false)", r.topic, r.partition, r.start, min(earliest, r.end) - 1)
                r = OffsetRange(r.topic, r.partition, min(earliest, r.end), r.end)
        try:
            yield from read_range(self.options.reader, r)
        except ReadIncomplete as exc:
            if exc.code not in _OFFSET_GONE or not self.options.fail_on_data_loss:
                raise
            raise ReadIncomplete(f"{exc}; set failOnDataLoss=false to skip deleted records and go on",
                                 code=exc.code, topic=exc.topic, partition=exc.partition) from exc
