"""Plain functions around the data source: write a DataFrame, read a batch and commit its offsets after success.

write_kafka() records the partition count of an exactly_once write so a re-run with another
partitioning is refused before it writes; KafkaBatch.commit() moves a group's offsets only once the
job that used the batch succeeded.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from reliable_kafka.errors import ConfigError, WriteRefused
from reliable_kafka.spark.jvm_sink import jvm_sink_refusal, write_with_jvm_sink
from reliable_kafka.spark.markers import Manifest, MarkerTopic, manifest_key
from reliable_kafka.spark.options import (
    AT_LEAST_ONCE,
    DEFAULT_MARKER_TOPIC,
    EXACTLY_ONCE,
    WriterOptions,
    reader_options,
    writer_options,
)
from reliable_kafka.spark.reader import OffsetRange, commit_group_offsets, offsets_json, resolve_ranges, schema_ddl
from reliable_kafka.spark.source import FORMAT, ReliableKafkaDataSource

log = logging.getLogger(__name__)


def register(spark: SparkSession) -> None:
    """Make format("reliable_kafka") known to this Spark session (safe to call more than once)."""
    spark.dataSource.register(ReliableKafkaDataSource)


@dataclass(frozen=True)
class WriteResult:
    write_id: str
    guarantee: str
    manifest: Manifest | None  # exactly_once: what the completed write id holds
    # Which writer wrote the rows: "python" (format("reliable_kafka"), a producer per task) or "jvm"
    # (at_least_once through Spark's own Kafka sink, see spark/jvm_sink.py).
    path: str = "python"

    @property
    def rows(self) -> int | None:
        return self.manifest.rows if self.manifest is not None else None


def write_kafka(
    df: DataFrame,
    bootstrap_servers: str,
    topic: str | None = None,
    *,
    guarantee: str = AT_LEAST_ONCE,
    write_id: str | None = None,
    num_partitions: int | None = None,
    options: Mapping[str, Any] | None = None,
    write_path: str = "auto",
) -> WriteResult:
    """df.write.format("reliable_kafka").save() with the options spelled as arguments.

    For exactly_once the partition count is taken from the DataFrame unless given (with adaptive
    query execution and a shuffle, finding it runs the shuffle once: pass num_partitions to avoid it).

    write_path: "auto" writes at_least_once through Spark's own Kafka sink, rk-ids computed in Spark SQL
    (no row passes through Python: several times faster), whenever that gives the same result (see
    spark/jvm_sink.py; it logs why not), else through format("reliable_kafka"); "jvm" insists (ConfigError
    saying why it cannot), "python" always takes format("reliable_kafka").
    """
    register(df.sparkSession)
    opts: dict[str, str] = {"kafka.bootstrap.servers": bootstrap_servers, "guarantee": guarantee}
    if topic is not None:
        opts["topic"] = topic
    if write_id is not None:
        opts["write_id"] = write_id
    if guarantee == EXACTLY_ONCE:
        opts["numPartitions"] = str(num_partitions or df.rdd.getNumPartitions())
    opts.update({k: str(v) for k, v in (options or {}).items()})
    parsed = writer_options(opts)  # refuse bad options here, with the caller's stack
    opts["write_id"] = parsed.write_id  # at_least_once: keep a generated id to report it
    if _takes_jvm_sink(df.sparkSession, parsed, write_path):
        try:
            write_with_jvm_sink(df, parsed)
        except Exception as exc:
            _raise_ours(exc)
            raise
        return WriteResult(parsed.write_id, parsed.guarantee, None, path="jvm")
    try:
        df.write.format(FORMAT).options(**opts).mode("append").save()
    except Exception as exc:
        _raise_ours(exc)
        raise
    manifest = read_manifest(parsed.kafka, parsed.write_id, parsed.marker_topic) if guarantee == EXACTLY_ONCE else None
    return WriteResult(parsed.write_id, parsed.guarantee, manifest)


WRITE_PATHS = ("auto", "jvm", "python")


def _takes_jvm_sink(spark: SparkSession, options: WriterOptions, write_path: str) -> bool:
    if write_path not in WRITE_PATHS:
        raise ConfigError("write_path", f"{write_path!r} is not one of {', '.join(WRITE_PATHS)}")
    if write_path == "python":
        return False
    refusal = jvm_sink_refusal(spark, options)
    if refusal is not None and write_path == "jvm":
        raise ConfigError("write_path", f"'jvm' cannot take this write: {refusal}; use write_path='auto' or 'python'")
    if refusal is not None and options.guarantee == AT_LEAST_ONCE:
        log.info("write %s: at_least_once through format(%r), not Spark's own sink: %s", options.write_id, FORMAT,
                 refusal)
    return refusal is None


# Spark reports a task's or the driver's Python exception as text inside its own exception type.
_OURS = re.compile(r"reliable_kafka\.errors\.(WriteRefused|ConfigError): (.+)")


def _raise_ours(exc: Exception) -> None:
    """Re-raise WriteRefused / ConfigError that Spark wrapped, so callers can catch our types."""
    found = _OURS.search(str(exc))
    if found is None:
        return
    kind, message = found.group(1), found.group(2).strip()
    if kind == "WriteRefused":
        raise WriteRefused(message) from exc
    key, _, reason = message.partition(": ")
    raise ConfigError(key, reason) from exc


def read_manifest(
    kafka: Mapping[str, Any] | str, write_id: str, marker_topic: str = DEFAULT_MARKER_TOPIC
) -> Manifest | None:
    """The manifest of a completed exactly_once write id, or None if it has not completed."""
    settings = {"bootstrap.servers": kafka} if isinstance(kafka, str) else dict(kafka)
    found = MarkerTopic(settings, marker_topic).read([manifest_key(write_id)]).get(manifest_key(write_id))
    return found if isinstance(found, Manifest) else None


@dataclass
class KafkaBatch:
    """A fixed set of offset ranges read as a DataFrame; commit() records their ends for a consumer group.

    The ranges are resolved once, when the batch is made, so every action on `df` reads the same
    records. Use it as a context manager to commit only when the block finished without an error.
    """

    df: DataFrame
    ranges: list[OffsetRange]
    kafka: dict[str, Any]
    group_id: str | None
    committed: bool = field(default=False, init=False)

    def commit(self) -> None:
        """Commit the end offset of every range for the group (call once the job succeeded)."""
        if not self.group_id:
            raise ConfigError("group_id", "commit() needs the consumer group the batch was read for")
        commit_group_offsets(self.kafka, self.group_id, {(r.topic, r.partition): r.end for r in self.ranges})
        self.committed = True
        log.info("group %s committed %d partition(s)", self.group_id, len(self.ranges))

    def __enter__(self) -> KafkaBatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.commit()


_CHOOSE_RANGES = frozenset({
    "subscribe", "subscribepattern", "startingtimestamp", "startingoffsetsbytimestamp", "endingtimestamp",
    "endingoffsetsbytimestamp", "startingoffsetsbytimestampstrategy",
})


def read_kafka(
    spark: SparkSession,
    bootstrap_servers: str,
    *,
    subscribe: str | list[str] | None = None,
    subscribe_pattern: str | None = None,
    assign: Mapping[str, list[int]] | None = None,
    starting_offsets: str = "earliest",
    ending_offsets: str = "latest",
    group_id: str | None = None,
    dedup_by_rk_id: bool = False,
    include_headers: bool = False,
    options: Mapping[str, Any] | None = None,
) -> KafkaBatch:
    """spark.read.format("reliable_kafka").load() with offsets pinned now, plus a commit for `group_id`."""
    register(spark)
    opts: dict[str, str] = {"kafka.bootstrap.servers": bootstrap_servers}
    if subscribe is not None:
        opts["subscribe"] = subscribe if isinstance(subscribe, str) else ",".join(subscribe)
    if subscribe_pattern is not None:
        opts["subscribePattern"] = subscribe_pattern
    if assign is not None:
        opts["assign"] = json.dumps({t: list(p) for t, p in assign.items()})
    if group_id is not None:
        opts["kafka.group.id"] = group_id
    opts.update(
        startingOffsets=starting_offsets,
        endingOffsets=ending_offsets,
        dedupByRkId=str(dedup_by_rk_id).lower(),
        includeHeaders=str(include_headers).lower(),
    )
    opts.update({k: str(v) for k, v in (options or {}).items()})
    parsed = reader_options(opts)
    ranges = resolve_ranges(parsed)
    # Pin the ranges: a DataFrame re-plans on every action, and "latest" would move between them. The
    # options that chose them give way to the pinned offsets (a timestamp would win over startingOffsets).
    pinned = {k: v for k, v in opts.items() if k.lower() not in _CHOOSE_RANGES}
    pinned["assign"] = json.dumps({t: sorted({r.partition for r in ranges if r.topic == t})
                                   for t in sorted({r.topic for r in ranges})})
    pinned["startingOffsets"] = offsets_json(ranges, "start")
    pinned["endingOffsets"] = offsets_json(ranges, "end")
    if not ranges:
        # Nothing to read: an empty DataFrame with the source's columns.
        df = spark.createDataFrame([], schema_ddl(include_headers))
    else:
        df = spark.read.format(FORMAT).options(**pinned).load()
    return KafkaBatch(df=df, ranges=ranges, kafka=dict(parsed.kafka), group_id=group_id)
