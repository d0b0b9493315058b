"""Parsing of the reliable_kafka Spark data source options (writer and reader) into typed settings.

Every option is checked once, on the driver, before a task runs: an unknown or refused option name, a
wrong value, a `kafka.*` setting the installed librdkafka does not take, or an unsafe one (refused by
reliable_kafka.config) is a ConfigError naming the option and the fix. No option is ignored silently.
"""

from __future__ import annotations

import difflib
import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reliable_kafka.config import (
    check_client_settings,
    consumer_config,
    producer_config,
    transactional_producer_config,
)
from reliable_kafka.errors import ConfigError

AT_LEAST_ONCE = "at_least_once"
EXACTLY_ONCE = "exactly_once"
GUARANTEES = (AT_LEAST_ONCE, EXACTLY_ONCE)

DEFAULT_MARKER_TOPIC = "rk-spark-markers"
# Offsets in JSON offset maps, as in Spark's Kafka source.
EARLIEST = -2
LATEST = -1

# A write id becomes part of transactional.ids, marker keys and rk-ids: keep it to safe characters.
_WRITE_ID = re.compile(r"^[A-Za-z0-9._\-]{1,200}$")

# Writer defaults that differ from reliable_kafka.config's: big batches and a short linger suit a
# bulk job, where latency of a single row does not matter. The user's kafka.* options still win.
_SPARK_PRODUCER_DEFAULTS: dict[str, Any] = {
    "linger.ms": 20,
    "batch.size": 1_000_000,
    # Java clients hash keys with murmur2: keyed rows land where Spark's own Kafka sink puts them.
    "partitioner": "murmur2_random",
}


# The option names each side takes, besides `kafka.*` (case does not matter: Spark passes them lower-cased).
# A streaming reader or writer passes its own extra names to reader_options() / writer_options().
WRITER_OPTIONS = frozenset({
    "topic", "includeHeaders",  # Spark's Kafka sink
    "guarantee", "write_id", "writeId", "numPartitions", "chunkRows", "chunkSeconds", "transactionTimeoutMs",
    "markerTopic", "markerTopicPartitions", "test.failFirstAttemptAfterRows",
})
READER_OPTIONS = frozenset({
    # Spark's Kafka source, batch options
    "subscribe", "subscribePattern", "assign", "startingOffsets", "endingOffsets", "startingTimestamp",
    "endingTimestamp", "startingOffsetsByTimestamp", "endingOffsetsByTimestamp",
    "startingOffsetsByTimestampStrategy", "failOnDataLoss", "minPartitions", "maxRecordsPerPartition",
    "groupIdPrefix", "includeHeaders",
    # ours
    "dedupByRkId", "readTimeoutSeconds", "maxBatchRows",
})
_STREAMING_ONLY = "is a streaming option: it applies to spark.readStream, not to a batch read"
# Spark Kafka options that this connector refuses, and why (a name given in extra_names is taken instead).
READER_REFUSED: dict[str, str] = {
    "kafkaConsumer.pollTimeoutMs": "has no counterpart: a task waits for its whole offset range at most "
                                   "readTimeoutSeconds (default 120), then fails with ReadIncomplete; set that",
    "fetchOffset.numRetries": "has no counterpart: offset lookups on the driver retry with backoff for up to 30 s; "
                              "leave it out",
    "fetchOffset.retryIntervalMs": "has no counterpart: offset lookups on the driver retry with backoff for up to "
                                   "30 s; leave it out",
    "maxOffsetsPerTrigger": _STREAMING_ONLY,
    "minOffsetsPerTrigger": _STREAMING_ONLY,
    "maxTriggerDelay": _STREAMING_ONLY,
    "path": "a Kafka source has no path: name the topics with subscribe, subscribePattern or assign",
}
WRITER_REFUSED: dict[str, str] = {
    "path": "a Kafka sink has no path: name the topic with the topic option (or a topic column)",
}


# Names Spark adds itself: CREATE TABLE ... USING hands the data source its provider's name.
_ADDED_BY_SPARK = frozenset({"provider"})


def check_option_names(
    options: Mapping[str, str], known: Iterable[str], refused: Mapping[str, str], *, side: str
) -> None:
    """Refuse a refused or unknown option name (`kafka.*` names are librdkafka's, checked elsewhere)."""
    known_by_lower = {name.lower(): name for name in known} | dict.fromkeys(_ADDED_BY_SPARK, "")
    refused_by_lower = {name.lower(): (name, why) for name, why in refused.items()}
    for key in options:
        lowered = key.lower()
        if lowered.startswith("kafka.") or lowered in known_by_lower:
            continue
        if lowered in refused_by_lower:
            name, why = refused_by_lower[lowered]
            raise ConfigError(name, why)
        close = difflib.get_close_matches(lowered, [k for k, v in known_by_lower.items() if v], n=1, cutoff=0.6)
        hint = f"; did you mean {known_by_lower[close[0]]}?" if close else ""
        raise ConfigError(key, f"is not an option of the reliable_kafka {side}{hint} (Kafka client settings "
                               "take the kafka. prefix)")


def _get(options: Mapping[str, str], name: str) -> str | None:
    # Spark hands over a case-insensitive dict; plain dicts (the Python API, tests) are matched the same way.
    if name in options:
        return options[name]
    lowered = name.lower()
    for key, value in options.items():
        if key.lower() == lowered:
            return value
    return None


def _int(options: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = _get(options, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, f"expected a whole number, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
    return value


def _float(options: Mapping[str, str], name: str, default: float, *, minimum: float) -> float:
    raw = _get(options, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, f"expected a number, got {raw!r}") from None
    if value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
    return value


def _choice(options: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    raw = _get(options, name)
    value = allowed[0] if raw is None else str(raw).strip().lower()
    if value not in allowed:
        raise ConfigError(name, f"must be one of {', '.join(allowed)}, got {raw!r}")
    return value


def _group_id_prefix(options: Mapping[str, str]) -> str:
    raw = _get(options, "groupIdPrefix")
    if raw is None:
        return "rk-spark-reader"
    if not raw.strip():
        raise ConfigError("groupIdPrefix", "is empty: give the prefix your group ACLs allow, or leave it out")
    return raw.strip()


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None:
        return default
    text = str(raw).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(name, f"expected true or false, got {raw!r}")


def kafka_client_options(options: Mapping[str, str]) -> dict[str, str]:
    """The `kafka.`-prefixed options with the prefix removed (as Spark's Kafka connector does), each name
    and value checked against the installed librdkafka here rather than failing in every task."""
    out = {key[len("kafka.") :]: value for key, value in options.items() if key.lower().startswith("kafka.")}
    if not str(out.get("bootstrap.servers", "")).strip():
        raise ConfigError("kafka.bootstrap.servers", "is required: where are the brokers?")
    check_client_settings(out, key_prefix="kafka.")
    return out


@dataclass(frozen=True)
class WriterOptions:
    """What a write needs to know; pickled from the driver to every task."""

    kafka: dict[str, str]
    topic: str | None
    guarantee: str
    write_id: str
    marker_topic: str
    marker_topic_partitions: int
    chunk_rows: int
    chunk_seconds: float
    transaction_timeout_ms: int
    num_partitions: int | None
    # Test-only fault injection (see docs/spark.md): None in every real job.
    fail_first_attempt_after_rows: int | None = None

    def producer_settings(self, transactional_id: str | None = None) -> dict[str, Any]:
        """Safe producer settings for a task; transactional when given a transactional.id."""
        user: dict[str, Any] = {**_SPARK_PRODUCER_DEFAULTS, **self.kafka}
        if transactional_id is None:
            # Only failures are reported back: a successful report per row would cost a Python call
            # per row. flush() returning 0 with no failure reported means every row was acknowledged.
            user["delivery.report.only.error"] = True
            return producer_config(user)
        user["transaction.timeout.ms"] = self.transaction_timeout_ms
        user["delivery.report.only.error"] = True  # commit_transaction() fails if any row failed
        return transactional_producer_config(user, transactional_id)


def writer_options(options: Mapping[str, str], *, extra_names: Iterable[str] = ()) -> WriterOptions:
    """Validate the writer's options (df.write.format("reliable_kafka").option(...)).

    `extra_names`: option names a caller (a streaming writer) takes itself, on top of WRITER_OPTIONS.
    """
    extra = frozenset(extra_names)
    check_option_names(options, WRITER_OPTIONS | extra, _without(WRITER_REFUSED, extra), side="writer")
    kafka = kafka_client_options(options)
    guarantee = (_get(options, "guarantee") or AT_LEAST_ONCE).strip().lower()
    if guarantee not in GUARANTEES:
        raise ConfigError("guarantee", f"must be one of {', '.join(GUARANTEES)}, got {guarantee!r}")
    write_id = _get(options, "write_id") or _get(options, "writeId")
    if write_id is None:
        if guarantee == EXACTLY_ONCE:
            raise ConfigError(
                "write_id",
                "is required for exactly_once: a re-run must reuse it so that nothing is written twice",
            )
        # at_least_once needs an id only to keep rk-ids stable across the retries of one job.
        write_id = uuid.uuid4().hex
    if not _WRITE_ID.match(write_id):
        raise ConfigError("write_id", f"use 1-200 letters, digits, '.', '_' or '-', got {write_id!r}")
    for key in ("transactional.id", "enable.auto.commit"):
        if key in kafka:
            raise ConfigError(f"kafka.{key}", "is chosen by the connector itself (one per write id and partition)")
    transaction_timeout_ms = _int(options, "transactionTimeoutMs", 60_000, minimum=10_000)
    chunk_seconds = _float(options, "chunkSeconds", 10.0, minimum=0.1)
    if chunk_seconds * 1000 > transaction_timeout_ms / 3:
        raise ConfigError(
            "chunkSeconds",
            f"{chunk_seconds}s leaves too little of transactionTimeoutMs={transaction_timeout_ms} for the "
            "commit itself; keep chunks under a third of the transaction timeout",
        )
    fail_after = _int(options, "test.failFirstAttemptAfterRows", 0, minimum=-1) or None
    opts = WriterOptions(
        kafka=kafka,
        topic=_get(options, "topic"),
        guarantee=guarantee,
        write_id=write_id,
        marker_topic=_get(options, "markerTopic") or DEFAULT_MARKER_TOPIC,
        marker_topic_partitions=_int(options, "markerTopicPartitions", 32, minimum=1),
        chunk_rows=_int(options, "chunkRows", 250_000, minimum=1),
        chunk_seconds=chunk_seconds,
        transaction_timeout_ms=transaction_timeout_ms,
        num_partitions=_int(options, "numPartitions", 0, minimum=0) or None,
        fail_first_attempt_after_rows=fail_after,
    )
    _bool(options, "includeHeaders", False)  # the headers column is written whenever present, as by Spark's sink
    opts.producer_settings()  # refuse unsafe kafka.* settings on the driver, not in every task
    return opts


@dataclass(frozen=True)
class ReaderOptions:
    """What a read needs to know; pickled from the driver to every task."""

    kafka: dict[str, str]
    subscribe: tuple[str, ...] = ()
    subscribe_pattern: str | None = None
    assign: dict[str, list[int]] = field(default_factory=dict)
    starting_offsets: str = "earliest"
    ending_offsets: str = "latest"
    include_headers: bool = False
    dedup_by_rk_id: bool = False
    read_timeout_s: float = 120.0
    max_batch_rows: int = 10_000
    # Timestamps (ms) to find offsets for: one for every partition, or {"topic": {"0": ts}}.
    starting_timestamp: int | None = None
    starting_offsets_by_timestamp: dict[str, dict[str, int]] | None = None
    ending_timestamp: int | None = None
    ending_offsets_by_timestamp: dict[str, dict[str, int]] | None = None
    # "error": no offset for a starting timestamp fails the read; "latest": start at the latest offset.
    timestamp_strategy: str = "error"
    fail_on_data_loss: bool = True
    min_partitions: int | None = None
    max_records_per_partition: int | None = None
    group_id_prefix: str = "rk-spark-reader"

    @property
    def group_id(self) -> str | None:
        return self.kafka.get("group.id")

    def consumer_settings(self) -> dict[str, Any]:
        """read_committed consumer settings for a reading task (no group membership, no commits)."""
        user: dict[str, Any] = dict(self.kafka)
        # Reading tasks assign partitions and never commit: a throwaway group id keeps them out of
        # any real group. A start offset that retention already deleted is an error, unless the
        # user chose failOnDataLoss=false.
        user["group.id"] = f"{self.group_id_prefix}-{uuid.uuid4().hex}"
        # failOnDataLoss=false (Spark's meaning): records retention deleted are skipped, not an error.
        user["auto.offset.reset"] = "error" if self.fail_on_data_loss else "earliest"
        return consumer_config(user)


def _parse_offsets(name: str, raw: str, *, allow: tuple[str, ...]) -> str:
    text = raw.strip()
    if text.lower() in allow:
        return text.lower()
    try:
        parsed = json.loads(text)
    except ValueError:
        raise ConfigError(name, f"expected {' or '.join(allow)} or a JSON offset map, got {raw!r}") from None
    if not isinstance(parsed, dict) or not all(
        isinstance(parts, dict) and all(isinstance(o, int) for o in parts.values()) for parts in parsed.values()
    ):
        raise ConfigError(name, 'a JSON offset map looks like {"topic": {"0": 23, "1": -2}} (-2 earliest, -1 latest)')
    return text


def _without(refused: Mapping[str, str], taken: frozenset[str]) -> dict[str, str]:
    lowered = {name.lower() for name in taken}
    return {name: why for name, why in refused.items() if name.lower() not in lowered}


def _timestamp(options: Mapping[str, str], name: str) -> int | None:
    raw = _get(options, name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, f"expected milliseconds since the epoch, got {raw!r}") from None
    if value < 0:
        raise ConfigError(name, f"expected milliseconds since the epoch (>= 0), got {value}")
    return value


def _timestamp_map(options: Mapping[str, str], name: str) -> dict[str, dict[str, int]] | None:
    raw = _get(options, name)
    if raw is None:
        return None
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict) or not all(
        isinstance(parts, dict) and all(str(p).isdigit() and isinstance(ts, int) and ts >= 0 for p, ts in parts.items())
        for parts in parsed.values()
    ):
        raise ConfigError(name, 'expected JSON like {"topic": {"0": 1700000000000}} (milliseconds since the epoch), '
                                f"got {raw!r}")
    return {str(topic): {str(int(p)): int(ts) for p, ts in parts.items()} for topic, parts in parsed.items()}


def reader_options(options: Mapping[str, str], *, extra_names: Iterable[str] = ()) -> ReaderOptions:
    """Validate the reader's options (spark.read.format("reliable_kafka").option(...)).

    `extra_names`: option names a caller (a streaming reader) takes itself, on top of READER_OPTIONS.
    """
    extra = frozenset(extra_names)
    check_option_names(options, READER_OPTIONS | extra, _without(READER_REFUSED, extra), side="reader")
    kafka = kafka_client_options(options)
    if "auto.offset.reset" in kafka:
        raise ConfigError("kafka.auto.offset.reset", "is chosen by the reader: startingOffsets (or a starting "
                                                     "timestamp) says where to start, failOnDataLoss what to do "
                                                     "when retention deleted records")
    subscribe = _get(options, "subscribe")
    pattern = _get(options, "subscribePattern")
    assign_raw = _get(options, "assign")
    if sum(x is not None for x in (subscribe, pattern, assign_raw)) != 1:
        raise ConfigError("subscribe", "give exactly one of subscribe, subscribePattern or assign")
    assign: dict[str, list[int]] = {}
    if assign_raw is not None:
        try:
            parsed = json.loads(assign_raw)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict) or not all(
            isinstance(v, list) and all(isinstance(p, int) for p in v) for v in parsed.values()
        ):
            raise ConfigError("assign", f'expected JSON like {{"topic": [0, 1]}}, got {assign_raw!r}')
        assign = {str(k): sorted(set(v)) for k, v in parsed.items()}
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError("subscribePattern", f"not a regular expression: {exc}") from None
    starting = _parse_offsets(
        "startingOffsets", _get(options, "startingOffsets") or "earliest", allow=("earliest", "latest", "committed")
    )
    if starting == "committed" and not kafka.get("group.id"):
        raise ConfigError("kafka.group.id", "is required with startingOffsets=committed")
    opts = ReaderOptions(
        kafka=kafka,
        subscribe=tuple(t.strip() for t in subscribe.split(",") if t.strip()) if subscribe else (),
        subscribe_pattern=pattern,
        assign=assign,
        starting_offsets=starting,
        ending_offsets=_parse_offsets("endingOffsets", _get(options, "endingOffsets") or "latest", allow=("latest",)),
        include_headers=_bool(options, "includeHeaders", False),
        dedup_by_rk_id=_bool(options, "dedupByRkId", False),
        read_timeout_s=_float(options, "readTimeoutSeconds", 120.0, minimum=1.0),
        max_batch_rows=_int(options, "maxBatchRows", 10_000, minimum=1),
        starting_timestamp=_timestamp(options, "startingTimestamp"),
        starting_offsets_by_timestamp=_timestamp_map(options, "startingOffsetsByTimestamp"),
        ending_timestamp=_timestamp(options, "endingTimestamp"),
        ending_offsets_by_timestamp=_timestamp_map(options, "endingOffsetsByTimestamp"),
        timestamp_strategy=_choice(options, "startingOffsetsByTimestampStrategy", ("error", "latest")),
        fail_on_data_loss=_bool(options, "failOnDataLoss", True),
        min_partitions=_int(options, "minPartitions", 0, minimum=1) if _get(options, "minPartitions") else None,
        max_records_per_partition=(_int(options, "maxRecordsPerPartition", 0, minimum=1)
                                   if _get(options, "maxRecordsPerPartition") else None),
        group_id_prefix=_group_id_prefix(options),
    )
    if opts.dedup_by_rk_id and (opts.min_partitions or opts.max_records_per_partition):
        name = "minPartitions" if opts.min_partitions else "maxRecordsPerPartition"
        raise ConfigError(name, "splits a Kafka partition over several tasks, but dedupByRkId drops copies only "
                                "within one task; leave one of them out")
    if subscribe is not None and not opts.subscribe:
        raise ConfigError("subscribe", "names no topic")
    opts.consumer_settings()  # refuse unsafe kafka.* settings (e.g. read_uncommitted) on the driver
    return opts


@dataclass(frozen=True)
class StreamReaderOptions:
    """What a streaming read needs beyond a batch read's options; pickled to every task."""

    reader: ReaderOptions
    # None: every micro-batch reads all that is committed (Spark's ReadAllAvailable).
    max_offsets_per_trigger: int | None = None
    fail_on_data_loss: bool = True
    commit_group_offsets: bool = False


# Names only a stream reader takes, and batch-read options a stream reader refuses (never ignores).
STREAM_READER_OPTIONS = frozenset({"maxOffsetsPerTrigger", "commitGroupOffsets"})
_NO_END = ("a stream has no end offset: use trigger(availableNow=True) to stop at what is committed now, "
           "or spark.read for a fixed range")
_ONE_TASK_PER_PARTITION = "is not supported by the stream source: a micro-batch reads one task per partition"
STREAM_READER_REFUSED: dict[str, str] = {
    "endingOffsets": _NO_END, "endingTimestamp": _NO_END, "endingOffsetsByTimestamp": _NO_END,
    "minPartitions": _ONE_TASK_PER_PARTITION, "maxRecordsPerPartition": _ONE_TASK_PER_PARTITION,
    "minOffsetsPerTrigger": "is not supported by the stream source: a trigger reads what is committed, up to "
                            "maxOffsetsPerTrigger",
    "maxTriggerDelay": "is not supported by the stream source (it goes with minOffsetsPerTrigger)",
    "dedupByRkId": "is not supported by the stream source: drop copies downstream, e.g. with "
                   "dropDuplicatesWithinWatermark on the rk-id header",
}


def stream_reader_options(options: Mapping[str, str]) -> StreamReaderOptions:
    """Validate a streaming read's options (spark.readStream.format("reliable_kafka").option(...))."""
    refused = {name.lower(): (name, why) for name, why in STREAM_READER_REFUSED.items()}
    for key in options:
        if key.lower() in refused:
            name, why = refused[key.lower()]
            raise ConfigError(name, why)
    reader = reader_options(options, extra_names=STREAM_READER_OPTIONS)
    commit = _bool(options, "commitGroupOffsets", False)
    if commit and not reader.group_id:
        raise ConfigError("kafka.group.id", "is required with commitGroupOffsets=true: which group's offsets?")
    return StreamReaderOptions(
        reader=reader,
        max_offsets_per_trigger=_int(options, "maxOffsetsPerTrigger", 0, minimum=1) or None,
        fail_on_data_loss=_bool(options, "failOnDataLoss", True),
        commit_group_offsets=commit,
    )
