"""The Spark read path: one task per (topic, partition, offset range), read_committed, Spark's Kafka columns.

A task reads until its consumer position reaches the range's end offset, so the offsets taken by
transaction markers and aborted records never stall it, and it returns no record of an aborted
transaction. With dedupByRkId it drops records whose rk-id it has already returned.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import pyarrow as pa
from confluent_kafka import (
    OFFSET_INVALID,
    TIMESTAMP_CREATE_TIME,
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, OffsetSpec
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from reliable_kafka import kafka_errors
from reliable_kafka.config import connection_settings, consumer_config
from reliable_kafka.errors import CommitFailed, ConfigError, ReadIncomplete
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.spark.options import EARLIEST, LATEST, ReaderOptions

log = logging.getLogger(__name__)

# The columns of Spark's own Kafka source, in its order (headers only with includeHeaders=true).
BASE_SCHEMA = (
    "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, timestampType int"
)
HEADERS_FIELD = "headers array<struct<key: string, value: binary>>"

_ARROW_FIELDS = [
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("topic", pa.string()),
    pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    pa.field("timestampType", pa.int32()),
]
_ARROW_HEADERS = pa.field(
    "headers", pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))
)
# Java's TimestampType ids, which Spark's Kafka source reports.
_TIMESTAMP_TYPE = {TIMESTAMP_CREATE_TIME: 0, TIMESTAMP_LOG_APPEND_TIME: 1}
_CALL_TIMEOUT_S = 30.0


def schema_ddl(include_headers: bool) -> str:
    return f"{BASE_SCHEMA}, {HEADERS_FIELD}" if include_headers else BASE_SCHEMA


@dataclass(frozen=True)
class OffsetRange(InputPartition):
    """Records [start, end) of one topic partition: what one Spark task reads."""

    topic: str
    partition: int
    start: int
    end: int


# ---- planning (driver) -----------------------------------------------------------------------------


def _selected_partitions(options: ReaderOptions, admin: AdminClient) -> list[TopicPartition]:
    md = retry_kafka_call(lambda: admin.list_topics(timeout=10), deadline_s=_CALL_TIMEOUT_S, what="list topics")
    topics = md.topics
    if options.assign:
        wanted = options.assign
    elif options.subscribe_pattern is not None:
        pattern = re.compile(options.subscribe_pattern)
        wanted = {name: sorted(t.partitions) for name, t in topics.items()
                  if pattern.fullmatch(name) and not name.startswith("__")}
    else:
        wanted = {}
        for name in options.subscribe:
            if name not in topics or topics[name].error is not None:
                raise ConfigError("subscribe", f"topic {name!r} does not exist")
            wanted[name] = sorted(topics[name].partitions)
    out = []
    for name, partitions in sorted(wanted.items()):
        known = topics.get(name)
        for p in partitions:
            if known is None or p not in known.partitions:
                raise ConfigError("assign", f"{name}[{p}] does not exist")
            out.append(TopicPartition(name, p))
    return out


def _list_offsets(admin: AdminClient, tps: list[TopicPartition], spec: OffsetSpec) -> dict[tuple[str, int], int]:
    def call() -> dict[tuple[str, int], int]:
        futures = admin.list_offsets(
            {tp: spec for tp in tps}, isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=10
        )
        return {(tp.topic, tp.partition): int(f.result().offset) for tp, f in futures.items()}

    return retry_kafka_call(call, deadline_s=_CALL_TIMEOUT_S, what="list offsets") if tps else {}


def _committed(options: ReaderOptions, tps: list[TopicPartition]) -> dict[tuple[str, int], int]:
    settings = consumer_config({**connection_settings(options.kafka), "group.id": options.group_id})
    consumer = Consumer(settings)
    try:
        found = retry_kafka_call(
            lambda: consumer.committed([TopicPartition(tp.topic, tp.partition) for tp in tps], timeout=10),
            deadline_s=_CALL_TIMEOUT_S, what="committed offsets",
        )
    finally:
        consumer.close()
    return {(tp.topic, tp.partition): tp.offset for tp in found if tp.offset >= 0}


def _from_json(raw: str) -> dict[tuple[str, int], int]:
    return offset_map(json.loads(raw))


def offset_map(parsed: Mapping[str, Mapping[str, int]]) -> dict[tuple[str, int], int]:
    """{(topic, partition): offset} of a parsed offset map in Spark's format ({"topic": {"0": 23}})."""
    return {(topic, int(p)): int(o) for topic, parts in parsed.items() for p, o in parts.items()}


def commit_group_offsets(kafka: Mapping[str, Any], group_id: str, offsets: Mapping[tuple[str, int], int]) -> None:
    """Commit `offsets` (the next offset to read, per partition) for `group_id`, as a consumer outside the group.

    Raises CommitFailed when the commit cannot be made (for instance while the group has active members).
    """
    tps = [TopicPartition(topic, partition, offset) for (topic, partition), offset in sorted(offsets.items())]
    if not tps:
        return
    consumer = Consumer(consumer_config({**connection_settings(kafka), "group.id": group_id}))
    try:
        result = retry_kafka_call(
            lambda: consumer.commit(offsets=tps, asynchronous=False), deadline_s=60.0, what="offset commit"
        )
    except Exception as exc:
        raise CommitFailed(f"could not commit offsets of group {group_id!r}: {exc}",
                           code=kafka_errors.name_of(exc) if isinstance(exc, KafkaException) else None) from exc
    finally:
        consumer.close()
    failed = [tp for tp in result or () if tp.error is not None]
    if failed:
        tp, error = failed[0], failed[0].error
        assert error is not None
        raise CommitFailed(f"group {group_id!r}: commit refused for {tp.topic}[{tp.partition}]: {error}",
                           code=kafka_errors.name_of(error), topic=tp.topic, partition=tp.partition)


def _pick(
    spec: str,
    default: int,
    earliest: dict[tuple[str, int], int],
    latest: dict[tuple[str, int], int],
    committed: dict[tuple[str, int], int],
) -> dict[tuple[str, int], int]:
    """Offsets per partition for one offset option (a JSON map falls back to `default` per partition)."""
    if spec == "committed":
        # A partition the group never committed starts at the beginning, as auto.offset.reset=earliest.
        return {key: committed.get(key, earliest[key]) for key in earliest}
    given = _from_json(spec) if spec.startswith("{") else {}
    base = EARLIEST if spec == "earliest" else LATEST if spec == "latest" else default
    out = {}
    for key in earliest:
        offset = given.get(key, base)
        out[key] = earliest[key] if offset == EARLIEST else latest[key] if offset == LATEST else offset
    return out


def _offsets_for_times(admin: AdminClient, wanted: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """The first offset whose timestamp is >= the given one, per partition; -1 where no record is that late."""
    def call() -> dict[tuple[str, int], int]:
        futures = admin.list_offsets(
            {TopicPartition(t, p): OffsetSpec.for_timestamp(ts) for (t, p), ts in wanted.items()},
            isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=10,
        )
        return {(tp.topic, tp.partition): int(f.result().offset) for tp, f in futures.items()}

    return retry_kafka_call(call, deadline_s=_CALL_TIMEOUT_S, what="offsets for times") if wanted else {}


def _timestamps(
    name: str, every: int | None, by_partition: dict[str, dict[str, int]] | None, keys: list[tuple[str, int]]
) -> dict[tuple[str, int], int] | None:
    """Timestamp per partition from startingTimestamp-style (all partitions) or ...ByTimestamp-style options."""
    if every is not None:
        return dict.fromkeys(keys, every)
    if by_partition is None:
        return None
    given = {(topic, int(p)): ts for topic, parts in by_partition.items() for p, ts in parts.items()}
    missing = [key for key in keys if key not in given]
    if missing:
        # As Spark's source: a partition without a timestamp has no defined start, so every one is named.
        topic, partition = missing[0]
        raise ConfigError(name, f"gives no timestamp for {topic}[{partition}]: name every partition the read "
                                f"selects ({len(missing)} missing)")
    extra = sorted(set(given) - set(keys))
    if extra:
        raise ConfigError(name, f"names {extra[0][0]}[{extra[0][1]}], which the read does not select")
    return given


def _start_by_timestamp(
    options: ReaderOptions, admin: AdminClient, stamps: dict[tuple[str, int], int], latest: dict[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    found = _offsets_for_times(admin, stamps)
    starts = {}
    for key, offset in found.items():
        if offset < 0:
            if options.timestamp_strategy == "error":
                raise ConfigError(
                    "startingOffsetsByTimestampStrategy",
                    f"{key[0]}[{key[1]}] has no record at or after timestamp {stamps[key]} (strategy error, the "
                    "default); set it to latest to start such partitions at their latest offset",
                )
            offset = latest[key]
        starts[key] = min(offset, latest[key])
    return starts


def _end_by_timestamp(
    admin: AdminClient, stamps: dict[tuple[str, int], int], latest: dict[tuple[str, int], int]
) -> dict[tuple[str, int], int]:
    # As Spark's source: no record at or after the ending timestamp means the end is the latest offset.
    return {key: latest[key] if offset < 0 else min(offset, latest[key])
            for key, offset in _offsets_for_times(admin, stamps).items()}


def log_bounds(
    options: ReaderOptions, admin: AdminClient | None = None
) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
    """(earliest offset, last stable offset) of every selected partition now: what a read can reach.

    The last stable offset (read_committed) is the end of what is committed: no open transaction
    lies below it, so a read that stops there never waits on one.
    """
    admin = admin or AdminClient(connection_settings(options.kafka))
    tps = _selected_partitions(options, admin)
    return _list_offsets(admin, tps, OffsetSpec.earliest()), _list_offsets(admin, tps, OffsetSpec.latest())


def starting_offsets(
    options: ReaderOptions, earliest: dict[tuple[str, int], int], latest: dict[tuple[str, int], int],
    admin: AdminClient | None = None,
) -> dict[tuple[str, int], int]:
    """Where the start options start each partition of `earliest`: as in Spark's source, startingTimestamp
    wins over startingOffsetsByTimestamp, which wins over startingOffsets."""
    stamps = _timestamps("startingOffsetsByTimestamp", options.starting_timestamp,
                         options.starting_offsets_by_timestamp, sorted(earliest))
    if stamps is not None:
        return _start_by_timestamp(options, admin or AdminClient(connection_settings(options.kafka)), stamps, latest)
    tps = [TopicPartition(topic, partition) for topic, partition in earliest]
    committed = _committed(options, tps) if options.starting_offsets == "committed" else {}
    return _pick(options.starting_offsets, EARLIEST, earliest, latest, committed)


def resolve_ranges(options: ReaderOptions) -> list[OffsetRange]:
    """Turn the offset options into concrete ranges (empty ones included), once, on the driver.

    "latest" is the last stable offset (read_committed): the end of what is committed now. As in Spark's
    source, startingTimestamp wins over startingOffsetsByTimestamp, which wins over startingOffsets (the
    same for the ending options).
    """
    admin = AdminClient(connection_settings(options.kafka))
    earliest, latest = log_bounds(options, admin)
    starts = starting_offsets(options, earliest, latest, admin)
    end_stamps = _timestamps("endingOffsetsByTimestamp", options.ending_timestamp,
                             options.ending_offsets_by_timestamp, sorted(earliest))
    if end_stamps is not None:
        ends = _end_by_timestamp(admin, end_stamps, latest)
    else:
        ends = _pick(options.ending_offsets, LATEST, earliest, latest, {})
    ranges = []
    for (topic, partition), start in sorted(starts.items()):
        end = ends[(topic, partition)]
        if not options.fail_on_data_loss and start < earliest[(topic, partition)]:
            # failOnDataLoss=false: what retention deleted is skipped (a range wholly deleted reads nothing).
            log.warning("%s[%d]: offsets %d..%d are no longer in the log; skipped (failOnDataLoss=false)",
                        topic, partition, start, earliest[(topic, partition)] - 1)
            start = max(start, min(earliest[(topic, partition)], end))
        if start > end:
            raise ConfigError(
                "startingOffsets", f"{topic}[{partition}] starts at {start}, after its end offset {end}"
            )
        ranges.append(OffsetRange(topic, partition, start, end))
    return ranges


def split_ranges(
    ranges: list[OffsetRange], *, min_partitions: int | None = None, max_records: int | None = None
) -> list[OffsetRange]:
    """Spark's minPartitions / maxRecordsPerPartition: cut the non-empty ranges into more, smaller tasks.

    maxRecordsPerPartition first cuts every range into pieces of at most that many offsets; then, while
    there are fewer pieces than minPartitions, each is cut in proportion to its share of all offsets
    (at least one piece each), as Spark's KafkaOffsetRangeCalculator does. Pieces cover each range exactly.
    """
    pieces = [r for r in ranges if r.start < r.end]
    if max_records is not None:
        pieces = [p for r in pieces for p in _divide(r, -(-(r.end - r.start) // max_records))]
    if min_partitions is not None and min_partitions > len(pieces):
        total = sum(r.end - r.start for r in pieces)
        pieces = [p for r in pieces for p in _divide(r, max(round((r.end - r.start) / total * min_partitions), 1))]
    return pieces


def _divide(r: OffsetRange, parts: int) -> list[OffsetRange]:
    size = r.end - r.start
    parts = max(1, min(parts, size))
    bounds = [r.start + size * i // parts for i in range(parts + 1)]
    return [OffsetRange(r.topic, r.partition, lo, hi) for lo, hi in itertools.pairwise(bounds)]


def offsets_json(ranges: list[OffsetRange], which: str) -> str:
    """A JSON offset map (Spark's format) of the ranges' start or end offsets."""
    return json.dumps(offset_dict({(r.topic, r.partition): r.start if which == "start" else r.end for r in ranges}))


def offset_dict(offsets: Mapping[tuple[str, int], int]) -> dict[str, dict[str, int]]:
    """The offset map in Spark's format ({"topic": {"0": 23}}), topics and partitions in order.

    Always the same order: a streaming query compares offsets as JSON text, and the same offsets in
    another order would look like new data.
    """
    out: dict[str, dict[str, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        out.setdefault(topic, {})[str(partition)] = offset
    return out


# ---- reading (tasks) -------------------------------------------------------------------------------


class _Columns:
    def __init__(self, include_headers: bool) -> None:
        self.include_headers = include_headers
        self.clear()

    def clear(self) -> None:
        self.keys: list[bytes | None] = []
        self.values: list[bytes | None] = []
        self.offsets: list[int] = []
        self.timestamps: list[int | None] = []
        self.timestamp_types: list[int] = []
        self.headers: list[Any] = []

    def __len__(self) -> int:
        return len(self.offsets)

    def batch(self, r: OffsetRange) -> pa.RecordBatch:
        n = len(self.offsets)
        arrays = [
            pa.array(self.keys, pa.binary()),
            pa.array(self.values, pa.binary()),
            pa.array([r.topic] * n, pa.string()),
            pa.array([r.partition] * n, pa.int32()),
            pa.array(self.offsets, pa.int64()),
            pa.array(self.timestamps, pa.timestamp("us", tz="UTC")),
            pa.array(self.timestamp_types, pa.int32()),
        ]
        fields = list(_ARROW_FIELDS)
        if self.include_headers:
            arrays.append(pa.array(self.headers, _ARROW_HEADERS.type))
            fields.append(_ARROW_HEADERS)
        return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))


def read_range(options: ReaderOptions, r: OffsetRange) -> Iterator[pa.RecordBatch]:
    """Every committed record of [r.start, r.end), as Arrow batches of at most maxBatchRows rows."""
    if r.start >= r.end:
        return
    consumer = Consumer(options.consumer_settings())
    seen: set[bytes] = set()
    columns = _Columns(options.include_headers)
    dropped = 0
    try:
        consumer.assign([TopicPartition(r.topic, r.partition, r.start)])
        tp = [TopicPartition(r.topic, r.partition)]
        deadline = time.monotonic() + options.read_timeout_s
        position = r.start
        while position < r.end:
            for msg in consumer.consume(num_messages=options.max_batch_rows, timeout=0.5):
                err = msg.error()
                if err is not None:
                    _raise_unless_transient(err, r)
                    continue
                offset = msg.offset()
                if offset is None or offset >= r.end:
                    continue
                headers = cast("list[tuple[str, bytes | None]] | None", msg.headers())
                if options.dedup_by_rk_id:
                    rk_id = _rk_id(headers)
                    if rk_id is not None:
                        if rk_id in seen:
                            dropped += 1
                            continue
                        seen.add(rk_id)
                columns.keys.append(cast("bytes | None", msg.key()))
                columns.values.append(cast("bytes | None", msg.value()))
                columns.offsets.append(offset)
                ts_type, ts = msg.timestamp()
                columns.timestamps.append(ts * 1000 if ts_type in _TIMESTAMP_TYPE else None)
                columns.timestamp_types.append(_TIMESTAMP_TYPE.get(ts_type, -1))
                if options.include_headers:
                    columns.headers.append([{"key": k, "value": v} for k, v in headers] if headers else None)
            # The position, not the last record, says how far the range is read: commit markers
            # and aborted records occupy offsets that a read_committed consumer never returns.
            now = consumer.position(tp)[0].offset
            if now != OFFSET_INVALID:
                position = max(position, now)
            if len(columns) >= options.max_batch_rows:
                yield columns.batch(r)
                columns.clear()
            if position < r.end and time.monotonic() > deadline:
                raise ReadIncomplete(
                    f"{r.topic}[{r.partition}]: reached offset {position} of [{r.start}, {r.end}) in "
                    f"{options.read_timeout_s:.0f}s (readTimeoutSeconds); is the leader up, or is a "
                    "transaction below the end offset still open?",
                    topic=r.topic,
                    partition=r.partition,
                )
        if len(columns):
            yield columns.batch(r)
    finally:
        consumer.close()
    if dropped:
        log.info("%s[%d]: dropped %d duplicate rk-id(s)", r.topic, r.partition, dropped)


def _rk_id(headers: list[tuple[str, bytes | None]] | None) -> bytes | None:
    found = None
    for key, value in headers or ():
        if key == ID_HEADER:
            found = value
    return found


def _raise_unless_transient(err: KafkaError, r: OffsetRange) -> None:
    code = err.code()
    if code in (KafkaError._AUTO_OFFSET_RESET, KafkaError.OFFSET_OUT_OF_RANGE):
        raise ReadIncomplete(
            f"{r.topic}[{r.partition}]: offset {r.start} is no longer in the log ({err.str()}): "
            "retention deleted records this read was asked for",
            code=kafka_errors.name_of(err),
            topic=r.topic,
            partition=r.partition,
        )
    if kafka_errors.classify(err) in (kafka_errors.Disposition.RETRIABLE, kafka_errors.Disposition.COORDINATOR):
        log.warning("%s[%d]: %s; still reading", r.topic, r.partition, kafka_errors.describe(err))
        return
    raise ReadIncomplete(f"{r.topic}[{r.partition}]: {kafka_errors.describe(err)}", code=kafka_errors.name_of(err),
                         topic=r.topic, partition=r.partition)


class KafkaReader(DataSourceReader):
    """The DataSourceReader Spark runs: ranges planned on the driver, read in tasks."""

    def __init__(self, options: ReaderOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema

    def partitions(self) -> list[InputPartition]:
        ranges: list[InputPartition] = list(split_ranges(
            resolve_ranges(self.options),
            min_partitions=self.options.min_partitions,
            max_records=self.options.max_records_per_partition,
        ))
        # Spark wants at least one partition; an empty range reads nothing.
        return ranges or [OffsetRange(f"rk-empty-{uuid.uuid4().hex[:6]}", 0, 0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, OffsetRange)
        return read_range(self.options, partition)
