"""Progress records of exactly-once Spark writes, kept in a compacted marker topic.

A partition marker is written in the same Kafka transaction as the rows it counts, so it is visible
exactly when they are; the manifest says a whole write id completed. Reads see only committed records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
import zlib
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, OffsetSpec

from reliable_kafka import kafka_errors
from reliable_kafka.config import connection_settings, consumer_config, keyed_record_config
from reliable_kafka.errors import PartitionWriteFailed, TopicConfigError
from reliable_kafka.retry import retry_kafka_call

log = logging.getLogger(__name__)

_VERSION = 1
# How long one consume() of a marker read may wait; the read loops until its position reaches the end.
_CONSUME_SLICE_S = 0.02


def partition_key(write_id: str, partition: int) -> str:
    return f"{write_id}/{partition}"


def manifest_key(write_id: str) -> str:
    return f"{write_id}/manifest"


def plan_key(write_id: str) -> str:
    return f"{write_id}/plan"


def marker_partition(key: str, partitions: int) -> int:
    """Where a record lives: stable, so every attempt and every re-run looks in the same place.

    The markers of one write id's Spark partitions go to consecutive marker partitions: a read waits
    for the open transactions on its marker partition, so tasks of one job must not share one (a
    crashed task's transaction would stall its neighbours until its retry fences it). The write-level
    records (plan, manifest) sit where partition 0's marker does. Never add partitions to a marker topic.
    """
    write_id, _, suffix = key.rpartition("/")
    base = zlib.crc32(write_id.encode())
    offset = int(suffix) if suffix.isdigit() else 0
    return (base + offset) % partitions


@dataclass(frozen=True)
class PartitionMarker:
    """How far one Spark partition of one write id got: its first `rows` rows are committed.

    `done` says the attempt that wrote it saw its input end; it is a hint, not proof of completeness
    (a worker that outlived its failed task may see a cut-off input end), so a retry always resumes.
    """

    write_id: str
    partition: int
    rows: int
    fingerprint: str
    chunks: int
    done: bool
    attempt: int
    num_partitions: int | None = None
    rows_written: int = 0  # rows the committing job run wrote itself (the rest were already there)

    def to_bytes(self) -> bytes:
        return json.dumps({"v": _VERSION, "kind": "partition", **asdict(self)}).encode()


@dataclass(frozen=True)
class Manifest:
    """A completed write id: every partition's row count and fingerprint, written at the driver's commit."""

    write_id: str
    num_partitions: int
    rows: int
    partitions: dict[int, PartitionMarker] = field(default_factory=dict)
    completed_at_ms: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "v": _VERSION,
                "kind": "manifest",
                "write_id": self.write_id,
                "num_partitions": self.num_partitions,
                "rows": self.rows,
                "completed_at_ms": self.completed_at_ms,
                "partitions": [asdict(m) for m in sorted(self.partitions.values(), key=lambda m: m.partition)],
            }
        ).encode()

    @property
    def rows_written(self) -> int:
        """Rows written by the job run that completed the write (0 when a re-run only verified)."""
        return sum(m.rows_written for m in self.partitions.values())


@dataclass(frozen=True)
class Plan:
    """The partition count a write id was started with (recorded when the caller knows it)."""

    write_id: str
    num_partitions: int

    def to_bytes(self) -> bytes:
        return json.dumps({"v": _VERSION, "kind": "plan", **asdict(self)}).encode()


Record = PartitionMarker | Manifest | Plan


def completed_keys(manifest: Manifest) -> list[str]:
    """The keys a completed write id holds besides its plan: its manifest and its partitions' markers.

    A partition that committed no chunk (an empty input) never wrote a marker, so it has no key here.
    """
    markers = [partition_key(manifest.write_id, p) for p, m in sorted(manifest.partitions.items()) if m.chunks > 0]
    return [*markers, manifest_key(manifest.write_id)]


def decode(raw: bytes | None) -> Record | None:
    """The record a marker-topic value holds (None for a tombstone)."""
    if raw is None:
        return None
    data = json.loads(raw)
    kind = data.pop("kind")
    data.pop("v", None)
    if kind == "partition":
        return PartitionMarker(**data)
    if kind == "plan":
        return Plan(**data)
    parts = {int(p["partition"]): PartitionMarker(**p) for p in data.pop("partitions")}
    return Manifest(partitions=parts, **data)


# Topic configs a marker topic is created with so that compaction actually shrinks what a marker read
# scans (every read starts at offset 0). Superseded markers of earlier chunks and the tombstones of
# released stream batches are removed only by the log cleaner, and it never touches the active segment.
COMPACTION_CONFIGS: dict[str, str] = {
    # The active segment is rolled (at the next append) once it is an hour old, whatever its size:
    # with the default 7 days and 1 GB a marker partition's records would stay in it, uncleaned, for a week.
    "segment.ms": str(3_600_000),
    # A record becomes eligible for compaction at most an hour after it was written, whatever the dirty
    # ratio (min.cleanable.dirty.ratio is left at its default: this bound on time is the one reads need).
    "max.compaction.lag.ms": str(3_600_000),
    # A tombstone stays readable for an hour after the cleaner first reaches it (default: a day).
    # Each released stream batch leaves (partitions + 1) tombstones, so this bounds what a busy stream's
    # reads scan. An hour is far longer than a read takes, and than a stale attempt of a released batch
    # lives (Spark destroys a killed task's Python worker after spark.python.task.killTimeout, 2 s by
    # default): while its tombstone is there, such an attempt is refused instead of writing again.
    "delete.retention.ms": str(3_600_000),
}


class MarkerTopic:
    """The compacted topic holding markers, plans and manifests, reached with the writer's connection settings."""

    def __init__(self, kafka: Mapping[str, Any], topic: str, *, timeout_s: float = 60.0) -> None:
        self.conn = connection_settings(kafka)
        self.topic = topic
        self.timeout_s = timeout_s
        self._partitions: int | None = None

    def _admin(self) -> AdminClient:
        return AdminClient(dict(self.conn))

    def ensure(self, partitions: int) -> None:
        """Create the marker topic if it is missing; refuse one that would not keep markers forever."""
        admin = self._admin()
        md = retry_kafka_call(lambda: admin.list_topics(timeout=10), deadline_s=self.timeout_s, what="list topics")
        if self.topic not in md.topics:
            brokers = len(md.brokers)
            rf = min(3, brokers)
            new = NewTopic(
                self.topic,
                num_partitions=partitions,
                replication_factor=rf,
                config={
                    # Compaction keeps the last record of every key forever: retention must never
                    # delete a marker, or a re-run would write a committed partition again.
                    "cleanup.policy": "compact",
                    "min.insync.replicas": str(min(2, rf)),
                    **COMPACTION_CONFIGS,
                },
            )
            try:
                admin.create_topics([new], operation_timeout=30)[self.topic].result(timeout=60)
                log.info("created marker topic %s (%d partitions, rf %d)", self.topic, partitions, rf)
            except KafkaException as exc:
                if kafka_errors.code_of(exc) != KafkaError.TOPIC_ALREADY_EXISTS:  # another driver won the race
                    raise
            self._wait_ready(admin)
        resource = ConfigResource(ConfigResource.Type.TOPIC, self.topic)
        # The broker that answers DescribeConfigs may not have the new topic in its metadata yet
        # (UNKNOWN_TOPIC_OR_PART for a moment after creation): retried like any retriable error.
        configs = retry_kafka_call(
            lambda: admin.describe_configs([resource], request_timeout=10)[resource].result(timeout=30),
            deadline_s=self.timeout_s,
            what=f"configuration of {self.topic}",
        )
        policy = configs["cleanup.policy"].value or ""
        if "compact" not in policy or "delete" in policy:
            raise TopicConfigError(
                self.topic,
                [f"cleanup.policy={policy}: markers would expire and a re-run would write committed rows "
                 "again; the marker topic needs cleanup.policy=compact"],
            )

    def _wait_ready(self, admin: AdminClient) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            md = admin.list_topics(self.topic, timeout=10)
            t = md.topics.get(self.topic)
            if t is not None and t.error is None and t.partitions and all(p.leader >= 0 for p in t.partitions.values()):
                return
            time.sleep(0.2)
        raise PartitionWriteFailed(f"marker topic {self.topic} has no leader for every partition yet", topic=self.topic)

    def partitions(self) -> int:
        if self._partitions is None:
            admin = self._admin()
            md = retry_kafka_call(
                lambda: admin.list_topics(self.topic, timeout=10), deadline_s=self.timeout_s, what="marker metadata"
            )
            t = md.topics.get(self.topic)
            if t is None or t.error is not None or not t.partitions:
                raise PartitionWriteFailed(
                    f"marker topic {self.topic} is missing ({t.error if t is not None else 'no metadata'}); "
                    "the driver creates it before the tasks run",
                    topic=self.topic,
                )
            self._partitions = len(t.partitions)
        return self._partitions

    def partition_of(self, key: str) -> int:
        return marker_partition(key, self.partitions())

    def read(self, keys: Collection[str]) -> dict[str, Record]:
        """The last committed record of each key (keys without one, or released ones, are absent)."""
        return {key: record for key, record in self.lookup(keys).items() if record is not None}

    def lookup(self, keys: Collection[str]) -> dict[str, Record | None]:
        """The last committed record of each key: None when it is a tombstone (the key was released),
        absent when the key was never written (or its tombstone was compacted away).

        The end is taken with read_uncommitted (the high watermark), then the partition is read with
        read_committed until the position reaches it: stopping at the last stable offset instead
        could miss a committed marker that sits behind another writer's open transaction.
        """
        by_partition: dict[int, set[str]] = {}
        for key in keys:
            by_partition.setdefault(self.partition_of(key), set()).add(key)
        found: dict[str, Record | None] = {}
        for partition, wanted in by_partition.items():
            for key, raw in self._read_partition(partition, wanted).items():
                found[key] = decode(raw)
        return found

    def _read_partition(self, partition: int, wanted: set[str]) -> dict[str, bytes | None]:
        tp = TopicPartition(self.topic, partition)
        admin = self._admin()

        def end_offset() -> int:
            futures = admin.list_offsets(
                {tp: OffsetSpec.latest()}, isolation_level=IsolationLevel.READ_UNCOMMITTED, request_timeout=10
            )
            return int(futures[tp].result().offset)

        end = retry_kafka_call(end_offset, deadline_s=self.timeout_s, what=f"end offset of {self.topic}[{partition}]")
        latest: dict[str, bytes | None] = {}
        if end <= 0:
            return latest
        consumer = Consumer(
            consumer_config(
                {**self.conn, "group.id": f"rk-spark-markers-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"}
            )
        )
        try:
            # The partition's leader known before assign(): assigned without one, librdkafka asks for the
            # BEGINNING offset only when its offset-query timer fires, 500 ms later. Without metadata
            # the read still works, that much slower.
            with contextlib.suppress(KafkaException):
                consumer.list_topics(self.topic, timeout=min(10.0, self.timeout_s))
            consumer.assign([TopicPartition(self.topic, partition, OFFSET_BEGINNING)])
            deadline = time.monotonic() + self.timeout_s
            while True:
                # Short: consume() waits out its timeout unless 10,000 records come, and the position,
                # not the records, says when the end is reached (a read of one marker took 0.62 s with
                # 0.2 s and no metadata first, 0.10 s as it is now).
                for msg in consumer.consume(num_messages=10_000, timeout=_CONSUME_SLICE_S):
                    err = msg.error()
                    if err is not None:
                        if kafka_errors.classify(err) is kafka_errors.Disposition.RETRIABLE:
                            continue
                        raise KafkaException(err)
                    raw_key = msg.key()
                    key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key or "")
                    if key in wanted:
                        value = msg.value()
                        latest[key] = value.encode() if isinstance(value, str) else value
                position = consumer.position([TopicPartition(self.topic, partition)])[0].offset
                if position >= end:
                    return latest
                if time.monotonic() > deadline:
                    raise PartitionWriteFailed(
                        f"reading markers of {self.topic}[{partition}] stopped at offset {position} of {end} "
                        f"after {self.timeout_s:.0f}s: a transaction below the end stayed open",
                        topic=self.topic,
                        partition=partition,
                    )
        finally:
            consumer.close()

    def put(self, key: str, value: bytes) -> None:
        """Write one record outside any transaction (plans and manifests), acknowledged by all in-sync replicas."""
        self._write({key: value})

    def release(self, write_id: str) -> list[str]:
        """Tombstone every record of a completed write id, so compaction can remove them; the keys released.

        Only for a write id that will never run again (a stream's micro-batch once a later one
        committed): an attempt of a released write id finds tombstones, not markers (see `lookup`). A write
        id without a manifest is left alone: its markers are what its retry or re-run resumes from.
        """
        found = self.read([manifest_key(write_id), plan_key(write_id)])  # one marker partition
        manifest = found.get(manifest_key(write_id))
        if not isinstance(manifest, Manifest):
            return []
        keys = completed_keys(manifest) + [key for key in (plan_key(write_id),) if key in found]
        self._write(dict.fromkeys(keys))
        log.info("released the %d marker-topic records of write %s", len(keys), write_id)
        return keys

    def _write(self, records: Mapping[str, bytes | None]) -> None:
        """Produce every record (None: a tombstone) with one producer and one flush; raise unless all were acked."""
        errors: list[str] = []

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(kafka_errors.describe(err))

        # A plan, a manifest or tombstones: one record per key, the same on a retry (keyed_record_config).
        producer = Producer(keyed_record_config({**self.conn, "linger.ms": 0}))
        for key, value in records.items():
            producer.produce(self.topic, value, key.encode(), self.partition_of(key), on_delivery=on_delivery)
        left = producer.flush(self.timeout_s)
        if left or errors:
            what = repr(next(iter(records))) if len(records) == 1 else f"{len(records)} records"
            raise PartitionWriteFailed(
                f"could not write {what} to {self.topic}: {errors[0] if errors else 'not acknowledged in time'}",
                topic=self.topic,
            )
