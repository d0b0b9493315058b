"""Parsing of the reliable_kafka Spark data source options (writer and reader) into typed settings.

Every option is checked once, on the driver, before a task runs: a wrong name or value is a
ConfigError naming the option, and unsafe Kafka client settings are refused by reliable_kafka.config.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from reliable_kafka.config import consumer_config, producer_config, transactional_producer_config
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
    """The `kafka.`-prefixed options with the prefix removed (as Spark's Kafka connector does)."""
    out = {key[len("kafka.") :]: value for key, value in options.items() if key.lower().startswith("kafka.")}
    if not str(out.get("bootstrap.servers", "")).strip():
        raise ConfigError("kafka.bootstrap.servers", "is required: where are the brokers?")
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


def writer_options(options: Mapping[str, str]) -> WriterOptions:
    """Validate the writer's options (df.write.format("reliable_kafka").option(...))."""
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

    @property
    def group_id(self) -> str | None:
        return self.kafka.get("group.id")

    def consumer_settings(self) -> dict[str, Any]:
        """read_committed consumer settings for a reading task (no group membership, no commits)."""
        user: dict[str, Any] = dict(self.kafka)
        # Reading tasks assign partitions and never commit: a throwaway group id keeps them out of
        # any real group. A start offset that retention already deleted is an error, never a skip.
        user["group.id"] = f"rk-spark-reader-{uuid.uuid4().hex}"
        user["auto.offset.reset"] = "error"
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


def reader_options(options: Mapping[str, str]) -> ReaderOptions:
    """Validate the reader's options (spark.read.format("reliable_kafka").option(...))."""
    kafka = kafka_client_options(options)
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
    )
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


def stream_reader_options(options: Mapping[str, str]) -> StreamReaderOptions:
    """Validate a streaming read's options (spark.readStream.format("reliable_kafka").option(...))."""
    if _get(options, "endingOffsets") is not None:
        raise ConfigError(
            "endingOffsets",
            "a stream has no end offset: use trigger(availableNow=True) to stop at what is committed now, "
            "or spark.read for a fixed range",
        )
    reader = reader_options(options)
    commit = _bool(options, "commitGroupOffsets", False)
    if commit and not reader.group_id:
        raise ConfigError("kafka.group.id", "is required with commitGroupOffsets=true: which group's offsets?")
    return StreamReaderOptions(
        reader=reader,
        max_offsets_per_trigger=_int(options, "maxOffsetsPerTrigger", 0, minimum=1) or None,
        fail_on_data_loss=_bool(options, "failOnDataLoss", True),
        commit_group_offsets=commit,
    )
