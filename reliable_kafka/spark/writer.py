"""The Spark write path: each task writes its partition's rows to Kafka, at_least_once or exactly_once.

at_least_once: idempotent producer, a deterministic rk-id per row, the task fails unless every row was
acknowledged. exactly_once: one transactional.id per (write id, partition), rows and a progress marker
committed together chunk by chunk, so a retry or a re-run skips what is committed and writes the rest once.
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from confluent_kafka import KafkaError, KafkaException, Producer
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import ArrayType, BinaryType, IntegerType, StringType, StructType

from reliable_kafka import kafka_errors, telemetry
from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.errors import (
    ConfigError,
    PartitionWriteFailed,
    TransactionalIdAuthorizationFailed,
    TransactionFenced,
    WriteRefused,
)
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.kafka_errors import Disposition
from reliable_kafka.producer_id import prime_producer_id
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.spark.fingerprint import Fingerprint
from reliable_kafka.spark.markers import (
    Manifest,
    MarkerTopic,
    PartitionMarker,
    Plan,
    manifest_key,
    partition_key,
    plan_key,
)
from reliable_kafka.spark.options import AT_LEAST_ONCE, EXACTLY_ONCE, WriterOptions

log = logging.getLogger(__name__)

# Rows without key and partition go to one Kafka partition per block of this many rows, chosen from
# the Spark partition and the row index: a retry sends every such row where its first copy went, so
# per-partition dedup by rk-id sees both copies (a random partitioner could split them).
STICKY_ROWS = 4096
_CALL_TIMEOUT_S = 30.0
# How often a fenced attempt reads the marker while it waits for the newer attempt's outcome.
FENCED_POLL_S = 1.0


@dataclass(frozen=True)
class PartitionCommit(WriterCommitMessage):
    """What one successful task attempt reports to the driver."""

    write_id: str
    partition: int
    attempt: int
    rows: int  # rows of the partition's input
    rows_written: int  # rows this attempt sent to Kafka
    resumed_from: int = 0  # rows an earlier attempt or run had already committed (exactly_once)
    skipped: bool = False  # the partition was already complete: nothing was written
    fingerprint: str = ""
    chunks: int = 0


# ---- input columns ------------------------------------------------------------------------------

_HEADER_TYPE = ArrayType(
    StructType().add("key", StringType()).add("value", BinaryType()),
)


def check_input_schema(schema: StructType, options: WriterOptions) -> None:
    """Refuse input a Kafka sink cannot write, naming the column (Spark's Kafka sink rules)."""
    fields = {f.name: f.dataType for f in schema.fields}
    if "value" not in fields:
        raise ConfigError("value", "the DataFrame needs a value column (string or binary)")
    for name in ("key", "value"):
        if name in fields and not isinstance(fields[name], (StringType, BinaryType)):
            raise ConfigError(name, f"column must be string or binary, not {fields[name].simpleString()}")
    if "topic" in fields and not isinstance(fields["topic"], StringType):
        raise ConfigError("topic", f"column must be string, not {fields['topic'].simpleString()}")
    if options.topic is None and "topic" not in fields:
        raise ConfigError("topic", "give the topic option or a topic column")
    if "partition" in fields and not isinstance(fields["partition"], IntegerType):
        raise ConfigError("partition", f"column must be int, not {fields['partition'].simpleString()}")
    if "headers" in fields:
        got = fields["headers"]
        if not (
            isinstance(got, ArrayType)
            and isinstance(got.elementType, StructType)
            and [(f.name, type(f.dataType)) for f in got.elementType.fields]
            == [("key", StringType), ("value", BinaryType)]
        ):
            raise ConfigError("headers", f"column must be {_HEADER_TYPE.simpleString()}, not {got.simpleString()}")


def _binary(column: pa.Array) -> list[Any]:
    if pa.types.is_string(column.type):
        column = column.cast(pa.binary())
    elif pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    return column.to_pylist()


def _pieces(batches: Iterable[pa.RecordBatch], room: Any) -> Iterator[pa.RecordBatch]:
    """Slices of the input, each at most `room()` rows long (room() is asked before every slice)."""
    for batch in batches:
        offset = 0
        while offset < batch.num_rows:
            size = min(max(1, room()), batch.num_rows - offset)
            yield batch.slice(offset, size)
            offset += size


# ---- sending rows ---------------------------------------------------------------------------------


class _Sender:
    """Turns Arrow rows into produce() calls: rk-id header, topic, key and partition per row."""

    def __init__(self, producer: Producer, options: WriterOptions, partition: int, deadline_s: float) -> None:
        self.producer = producer
        self.options = options
        self.partition = partition
        self.id_prefix = f"{options.write_id}:{partition}:".encode()
        self.deadline_s = deadline_s
        # The task's publish span (write_partition), carried by every row so its consumers link to it.
        self.trace: dict[str, bytes] = dict(telemetry.context_headers()) if telemetry.tracing_enabled() else {}
        self._partition_counts: dict[str, int] = {}

    def _count(self, topic: str) -> int:
        count = self._partition_counts.get(topic)
        if count is None:
            md = retry_kafka_call(
                lambda: self.producer.list_topics(topic, timeout=10), deadline_s=_CALL_TIMEOUT_S, what="metadata"
            )
            meta = md.topics.get(topic)
            if meta is None or meta.error is not None or not meta.partitions:
                raise PartitionWriteFailed(
                    f"topic {topic!r} is not available ({meta.error if meta is not None else 'no metadata'}): "
                    "create it before writing",
                    topic=topic,
                )
            count = self._partition_counts[topic] = len(meta.partitions)
        return count

    def send(self, piece: pa.RecordBatch, first_row: int) -> None:
        """produce() every row of `piece`; `first_row` is the index of its first row in the partition."""
        names = piece.schema.names
        if self.options.topic is not None and not {"key", "partition", "headers"} & set(names):
            self._send_values(piece, first_row, self.options.topic)
        else:
            self._send_rows(piece, first_row)
        self.producer.poll(0)

    def _send_values(self, piece: pa.RecordBatch, first_row: int, topic: str) -> None:
        # The common case, kept lean: values only, one topic; one partition per block of rows.
        values = _binary(piece.column("value"))
        count = self._count(topic)
        produce, prefix, n, trace = self.producer.produce, self.id_prefix, piece.num_rows, self.trace
        start = 0
        while start < n:
            row = first_row + start
            end = min(n, start + STICKY_ROWS - row % STICKY_ROWS)
            part = (self.partition + row // STICKY_ROWS) % count
            for i in range(start, end):
                # A dict is the cheapest header form confluent-kafka takes.
                header: dict[str, str | bytes | None] = {ID_HEADER: b"%s%d" % (prefix, first_row + i)}
                if trace:
                    header.update(trace)
                try:
                    # Positional, as below: the headers keyword alone cost 0.25 µs of a ~1 µs call.
                    produce(topic, values[i], None, part, None, None, 0, header)
                except BufferError:
                    self._wait_for_room(topic, values[i], None, part, header)
            start = end

    def _send_rows(self, piece: pa.RecordBatch, first_row: int) -> None:
        n = piece.num_rows
        names = piece.schema.names
        values = _binary(piece.column("value"))
        keys = _binary(piece.column("key")) if "key" in names else [None] * n
        if self.options.topic is not None:
            topics = [self.options.topic] * n
        else:
            topics = piece.column("topic").to_pylist()
            if None in topics:
                raise ConfigError("topic", "a row has a null topic and no topic option is set")
        parts = piece.column("partition").to_pylist() if "partition" in names else [None] * n
        ids = [b"%s%d" % (self.id_prefix, i) for i in range(first_row, first_row + n)]
        headers: list[Any]
        trace = self.trace
        if "headers" in names:
            # A context the rows bring along (copied from their source) gives way to this task's.
            own = list(trace.items())
            headers = [
                [(h["key"], h["value"]) for h in (row or ()) if not (own and h["key"] in telemetry.CONTEXT_HEADERS)]
                + [(ID_HEADER, rk_id), *own]
                for row, rk_id in zip(piece.column("headers").to_pylist(), ids, strict=True)
            ]
        else:
            headers = [{ID_HEADER: rk_id, **trace} for rk_id in ids]
        for j in range(n):
            if parts[j] is None:
                parts[j] = -1 if keys[j] is not None else (
                    (self.partition + (first_row + j) // STICKY_ROWS) % self._count(topics[j])
                )
        produce = self.producer.produce
        for topic, value, key, part, hdr in zip(topics, values, keys, parts, headers, strict=True):
            try:
                # Positional, as in ReliableProducer._produce: keywords cost ~1 µs a call.
                produce(topic, value, key, part, None, None, 0, hdr)
            except BufferError:
                self._wait_for_room(topic, value, key, part, hdr)

    def _wait_for_room(self, topic: str, value: Any, key: Any, part: int, hdr: Any) -> None:
        # The local queue is full: serve delivery reports until there is room, for a bounded time.
        if not produce_when_room(self.producer, topic, value, key, part, None, None, 0, hdr, timeout_s=self.deadline_s):
            raise PartitionWriteFailed(f"the producer queue stayed full for {self.deadline_s:.0f}s; is the cluster up?")


def _is_fatal(exc: BaseException) -> bool:
    """The producer is unusable (fenced, or a fatal librdkafka error): it cannot even abort."""
    if isinstance(exc, TransactionFenced):
        return True
    return isinstance(exc, KafkaException) and kafka_errors.classify(exc) is Disposition.FATAL


def _injected_failure(options: WriterOptions, partition: int, rows: int) -> RuntimeError:
    return RuntimeError(
        f"reliable_kafka test hook: attempt 0 of partition {partition} of write {options.write_id} fails "
        f"after {rows} rows (option test.failFirstAttemptAfterRows)"
    )


def _hook_rows(options: WriterOptions, attempt: int) -> int | None:
    """Rows after which this attempt must fail (test hook), -1 for 'after everything', None for never."""
    if attempt != 0:
        return None
    return options.fail_first_attempt_after_rows


# ---- at_least_once ------------------------------------------------------------------------------


def _write_at_least_once(
    options: WriterOptions, batches: Iterable[pa.RecordBatch], partition: int, attempt: int
) -> PartitionCommit:
    failures: list[str] = []

    def on_delivery(err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            failures.append(f"{kafka_errors.describe(err)} (rk-id {_rk_id(msg)})")

    settings = options.producer_settings()
    settings["on_delivery"] = on_delivery
    producer = Producer(settings)
    prime_producer_id(producer)  # its rows follow at once: without it the first waited 0.5 s for an id
    timeout_s = int(settings["message.timeout.ms"]) / 1000 + 10
    sender = _Sender(producer, options, partition, timeout_s)
    hook = _hook_rows(options, attempt)
    rows = 0
    try:
        room = (lambda: hook - rows) if hook is not None and hook >= 0 else (lambda: 1 << 30)
        for piece in _pieces(batches, room):
            sender.send(piece, rows)
            rows += piece.num_rows
            if failures:
                raise PartitionWriteFailed(f"{len(failures)} row(s) were not delivered: {failures[0]}")
            if hook is not None and hook >= 0 and rows >= hook:
                producer.flush(timeout_s)  # the rows reach Kafka before the "crash": a retry duplicates them
                raise _injected_failure(options, partition, rows)
        left = producer.flush(timeout_s)
        if failures or left:
            raise PartitionWriteFailed(
                f"{len(failures) + left} of {rows} row(s) of partition {partition} were not delivered: "
                + (failures[0] if failures else f"{left} still unacknowledged after {timeout_s:.0f}s")
            )
    except BaseException as exc:
        # The task fails and Spark retries it with the same rk-ids: queued rows need not go out now.
        producer.purge(in_queue=True, in_flight=False, blocking=False)
        producer.flush(0)
        if isinstance(exc, KafkaException):  # e.g. a fatal idempotence error: the producer is unusable
            raise PartitionWriteFailed(
                f"writing partition {partition} of write {options.write_id!r} failed: {kafka_errors.describe(exc)}",
                code=kafka_errors.name_of(exc),
            ) from exc
        raise
    if hook == -1:
        raise _injected_failure(options, partition, rows)
    return PartitionCommit(options.write_id, partition, attempt, rows=rows, rows_written=rows)


def _rk_id(msg: Any) -> str:
    headers = msg.headers() if msg is not None else None
    for key, value in headers or ():
        if key == ID_HEADER and value is not None:
            return str(value.decode())
    return "?"


# ---- exactly_once -------------------------------------------------------------------------------


# Every transactional.id of the exactly_once writer starts with it: the grant is one prefixed ACL.
TRANSACTIONAL_ID_PREFIX = "rk-spark-"


def transactional_id(scope: str, partition: int) -> str:
    """One per (scope, Spark partition), never per attempt: a new attempt fences the old one.

    The scope is the write id of a batch write, the query of a stream (one id for all its micro-batches:
    a zombie of an earlier batch is fenced too, and the broker keeps one id per partition, not per batch).
    """
    return f"{TRANSACTIONAL_ID_PREFIX}{scope}-{partition}"


class _ExactlyOnce:
    """One task attempt of an exactly_once write.

    A marker only ever means "the first `rows` rows of this partition are committed": never "the
    partition is complete". A failed attempt's Python worker can outlive its Spark task and see its
    input end early (the JVM closed the stream), so what it believed was the end may be a prefix.
    Completeness is decided by an attempt Spark accepted, recorded in the driver's manifest.
    """

    def __init__(self, options: WriterOptions, partition: int, attempt: int, transaction_scope: str | None = None
                 ) -> None:
        self.options = options
        self.partition = partition
        self.attempt = attempt
        self.key = partition_key(options.write_id, partition)
        self.transactional_id = transactional_id(transaction_scope or options.write_id, partition)
        self.markers = MarkerTopic(options.kafka, options.marker_topic)
        self.fingerprint = Fingerprint(seed=options.topic or "")
        self.crashed = False  # the test hook "crashed" this attempt: leave its transaction open
        self.producer: Producer | None = None
        # librdkafka tells the reason of a fatal state only to error_cb; produce() then says just _FATAL.
        self.fatal = kafka_errors.FatalError()

    def verify_complete(self, batches: Iterable[pa.RecordBatch], done: PartitionMarker) -> PartitionCommit:
        """The write id completed: check this partition's input is exactly the same, write nothing."""
        for batch in batches:
            self.fingerprint.update(batch)
        self._check_same(done, self.fingerprint.rows, exact=True)
        return PartitionCommit(
            self.options.write_id, self.partition, self.attempt, rows=done.rows, rows_written=0,
            resumed_from=done.rows, skipped=True, fingerprint=done.fingerprint, chunks=done.chunks,
        )

    def _check_same(self, marker: PartitionMarker, rows: int, *, exact: bool) -> None:
        digest = self.fingerprint.digest()
        if (exact and rows != marker.rows) or rows < marker.rows or digest != marker.fingerprint:
            raise WriteRefused(
                f"write {self.options.write_id!r}, partition {self.partition}: the input changed since "
                f"{'the write completed' if exact else 'an earlier attempt committed part of it'} "
                f"(committed {marker.rows} rows with fingerprint {marker.fingerprint}; this input has "
                f"{rows if exact or rows < marker.rows else 'at least ' + str(rows)} rows, and its first "
                f"{self.fingerprint.rows} have fingerprint {digest}). Inputs must be deterministic per "
                "partition; use a new write id for new data."
            )

    def run(self, batches: Iterable[pa.RecordBatch], manifest: Manifest | None) -> PartitionCommit:
        if manifest is not None:
            if self.partition >= manifest.num_partitions:
                raise WriteRefused(
                    f"write {self.options.write_id!r} completed with {manifest.num_partitions} partitions; "
                    f"this job has a partition {self.partition}: the partitioning changed"
                )
            return self.verify_complete(batches, manifest.partitions[self.partition])
        # Look at the input before fencing anyone: a worker that outlived its failed task finds its
        # input cut off here, and must not fence (and so fail) the live retry of its partition.
        source = iter(batches)
        first = next(source, None)
        if first is None:
            return self._empty_input()
        settings = self.options.producer_settings(self.transactional_id)
        self.fatal = kafka_errors.FatalError(settings.get("error_cb"))
        settings["error_cb"] = self.fatal
        producer = self.producer = Producer(settings)
        try:
            return self._run(producer, itertools.chain([first], source))
        except KafkaException as exc:  # from produce/begin/flush; commit and init are mapped where called
            raise self._failure(exc, "writing rows") from exc
        finally:
            if not self.crashed:
                self._close_quietly(producer)

    def _empty_input(self) -> PartitionCommit:
        """Nothing to write: no transaction, only a check that no earlier attempt committed rows."""
        marker = self.markers.read([self.key]).get(self.key)
        if isinstance(marker, PartitionMarker) and marker.rows > 0:
            self._check_same(marker, 0, exact=False)
        return PartitionCommit(
            self.options.write_id, self.partition, self.attempt, rows=0, rows_written=0, skipped=True,
            fingerprint=self.fingerprint.digest(),
        )

    def _committed_marker(self) -> PartitionMarker | None:
        """This partition's marker, read after init_transactions; refused when the write id was released.

        A tombstone in place of the marker means the write id completed and a later stream batch
        released its records (MarkerTopic.release): this is a stale attempt of a micro-batch Spark has
        committed, and with no marker to resume from it would write the partition's rows again.
        """
        found = self.markers.lookup([self.key])
        if self.key in found and found[self.key] is None:
            raise WriteRefused(
                f"write {self.options.write_id!r}, partition {self.partition}: the write completed and its "
                "markers were released after a later micro-batch of its stream committed; this attempt of an "
                "already committed batch writes nothing (Spark never replays such a batch: was the query's "
                "checkpoint changed by hand?)"
            )
        marker = found.get(self.key)
        if marker is not None and not isinstance(marker, PartitionMarker):
            raise PartitionWriteFailed(f"marker topic record {self.key!r} is not a partition marker: {marker!r}")
        return marker

    def _run(self, producer: Producer, batches: Iterable[pa.RecordBatch]) -> PartitionCommit:
        options = self.options
        # Fences every older attempt of this partition (a retry's predecessor, a speculative twin, a
        # worker that outlived its task) and settles its open transaction, so the marker read next
        # shows every chunk that will ever commit.
        self._call(lambda: producer.init_transactions(_CALL_TIMEOUT_S), "init_transactions")
        marker = self._committed_marker()
        known = marker.num_partitions if marker is not None else None
        if options.num_partitions and known not in (None, options.num_partitions):
            raise WriteRefused(
                f"write {options.write_id!r} was started with {known} partitions; "
                f"this job has {options.num_partitions}: the partitioning changed"
            )
        resume = marker.rows if marker is not None else 0
        chunks = marker.chunks if marker is not None else 0
        sender = _Sender(producer, options, self.partition, options.transaction_timeout_ms / 1000)
        hook = _hook_rows(options, self.attempt)
        state = {"in_chunk": 0, "sent": 0, "committed": 0}  # committed: of the rows sent, those committed
        chunk_started = time.monotonic()
        open_txn = False

        def room() -> int:
            limits = [options.chunk_rows - state["in_chunk"]]
            if self.fingerprint.rows < resume:
                limits.append(resume - self.fingerprint.rows)
            if hook is not None and hook >= 0:
                limits.append(max(1, hook - state["sent"]))
            return min(limits)

        pieces = _pieces(batches, room)
        try:
            for piece in pieces:
                row = self.fingerprint.rows
                self.fingerprint.update(piece)
                if row < resume:  # committed by an earlier attempt: only prove it is the same input
                    if self.fingerprint.rows == resume:
                        assert marker is not None
                        self._check_same(marker, resume, exact=False)
                    continue
                if not open_txn:
                    producer.begin_transaction()
                    open_txn, chunk_started = True, time.monotonic()
                sender.send(piece, row)
                state["in_chunk"] += piece.num_rows
                state["sent"] += piece.num_rows
                if hook is not None and hook >= 0 and state["sent"] >= hook:
                    producer.flush(_CALL_TIMEOUT_S)  # the rows sit in the log, uncommitted, when we "crash"
                    # A crash leaves the transaction open: the retry's init_transactions settles it.
                    open_txn, self.crashed = False, True
                    raise _injected_failure(options, self.partition, state["sent"])
                if state["in_chunk"] >= options.chunk_rows or time.monotonic() - chunk_started >= options.chunk_seconds:
                    chunks += 1
                    self._commit(producer, chunks, done=False, rows_written=state["sent"])
                    open_txn, state["in_chunk"], state["committed"] = False, 0, state["sent"]
            if self.fingerprint.rows < resume:
                assert marker is not None
                self._check_same(marker, self.fingerprint.rows, exact=False)
            if open_txn:
                chunks += 1
                self._commit(producer, chunks, done=True, rows_written=state["sent"])
                open_txn = False
        except BaseException as exc:
            if open_txn and not _is_fatal(exc):
                self._abort_quietly(producer)
            fenced = self._as_fence(exc)
            if fenced is None or self.crashed:
                raise
            return self._outcome_after_fence(pieces, fenced, resume=resume, rows_written=state["committed"])
        if hook == -1:
            raise _injected_failure(options, self.partition, state["sent"])
        return PartitionCommit(
            options.write_id, self.partition, self.attempt, rows=self.fingerprint.rows, rows_written=state["sent"],
            resumed_from=resume, skipped=state["sent"] == 0, fingerprint=self.fingerprint.digest(), chunks=chunks,
        )

    def _as_fence(self, exc: BaseException) -> TransactionFenced | None:
        """The TransactionFenced that `exc` is or means (a produce() refused after fencing), else None."""
        if isinstance(exc, TransactionFenced):
            return exc
        if isinstance(exc, KafkaException):
            failure = self._failure(exc, "writing rows")
            if isinstance(failure, TransactionFenced):
                failure.__cause__ = exc
                return failure
        return None

    def _outcome_after_fence(self, pieces: Iterator[pa.RecordBatch], fenced: TransactionFenced, *, resume: int,
                             rows_written: int) -> PartitionCommit:
        """A newer attempt of this partition fenced this one: end with its outcome rather than fail.

        The newer attempt is Spark's speculative copy, or a retry started while this attempt still ran.
        Failing here would count against spark.task.maxFailures although nothing went wrong: with
        speculation and a slow partition on every host, those failures added up until Spark aborted the
        job. So this attempt waits for the newer one to commit the partition's last chunk. Spark then
        kills it (killed, not failed), or, if it sees the marker first, it reads the rest of its input
        and ends with the newer attempt's outcome once its own rows and fingerprint are the same (Spark
        keeps the first success of a task and ignores the other). The wait ends with the fence raised
        when the marker has not moved for the transaction timeout (a live writer commits a chunk every
        chunkSeconds, at most a third of it, while its input flows: the newer attempt is gone too, and a
        retry must take over), or when this input turns out to be a cut-off prefix (a worker that outlived
        its task).
        """
        log.info("write %s partition %d attempt %d was fenced by a newer attempt; waiting for its outcome "
                 "(%s)", self.options.write_id, self.partition, self.attempt, fenced)
        stall_s = self.options.transaction_timeout_ms / 1000
        seen: tuple[int, int, bool] | None = None
        moved = time.monotonic()
        while True:
            marker = self.markers.read([self.key]).get(self.key)
            if isinstance(marker, PartitionMarker) and marker.done:
                break
            now = time.monotonic()
            state = (marker.rows, marker.chunks, marker.done) if isinstance(marker, PartitionMarker) else None
            if state != seen:
                seen, moved = state, now
            elif now - moved > stall_s:
                raise fenced
            time.sleep(FENCED_POLL_S)
        for piece in pieces:  # the rest of this input, to compare it with what the newer attempt wrote
            self.fingerprint.update(piece)
        if self.fingerprint.rows != marker.rows:
            raise fenced  # a cut-off input (or the newer attempt's own is): this attempt proves nothing
        self._check_same(marker, self.fingerprint.rows, exact=True)
        log.info("write %s partition %d attempt %d ends with the outcome of attempt %d (%d rows committed)",
                 self.options.write_id, self.partition, self.attempt, marker.attempt, marker.rows)
        return PartitionCommit(
            self.options.write_id, self.partition, self.attempt, rows=marker.rows, rows_written=rows_written,
            resumed_from=resume, skipped=rows_written == 0, fingerprint=marker.fingerprint, chunks=marker.chunks,
        )

    def _commit(self, producer: Producer, chunks: int, *, done: bool, rows_written: int) -> None:
        """Put the progress marker into the open transaction and commit rows and marker together."""
        marker = PartitionMarker(
            write_id=self.options.write_id, partition=self.partition, rows=self.fingerprint.rows,
            fingerprint=self.fingerprint.digest(), chunks=chunks, done=done, attempt=self.attempt,
            num_partitions=self.options.num_partitions, rows_written=rows_written,
        )
        try:
            producer.produce(
                self.options.marker_topic, marker.to_bytes(), self.key.encode(), self.markers.partition_of(self.key)
            )
        except KafkaException as exc:
            raise self._failure(exc, "writing the marker") from exc
        self._call(lambda: producer.commit_transaction(_CALL_TIMEOUT_S), "commit_transaction")
        log.info("write %s partition %d: committed chunk %d (%d rows, done=%s)",
                 self.options.write_id, self.partition, chunks, marker.rows, done)

    def _call(self, fn: Any, what: str) -> None:
        try:
            retry_kafka_call(fn, deadline_s=self.options.transaction_timeout_ms / 1000, what=what)
        except KafkaException as exc:
            raise self._failure(exc, what) from exc

    def _failure(self, exc: KafkaException, what: str) -> Exception:
        # A fenced producer answers _FATAL ("Local: Fatal error") to a later produce(): only the producer's
        # fatal error tells that it was a fence.
        fatal = self.fatal.seen(self.producer)
        cause = fatal if fatal is not None and kafka_errors.code_of(exc) == KafkaError._FATAL else None
        reason = (f"{what} failed for write {self.options.write_id!r} partition {self.partition}: "
                  f"{kafka_errors.describe(exc)}"
                  + (f" (the producer's fatal error: {kafka_errors.describe(cause)})" if cause else ""))
        if kafka_errors.is_fenced(exc, fatal):
            return TransactionFenced(f"{reason}; a newer attempt of this partition took over",
                                     code=kafka_errors.name_of(cause or exc))
        if kafka_errors.code_of(exc) == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
            # Every retry of the task is refused alike: say which grant the job's principal needs.
            return TransactionalIdAuthorizationFailed(
                self.transactional_id, what, kafka_errors.describe(exc),
                prefix=TRANSACTIONAL_ID_PREFIX)
        if kafka_errors.classify(exc) is Disposition.ABORTABLE:
            return PartitionWriteFailed(
                f"{reason}; the chunk was aborted and a retry resumes after the last committed one"
            )
        return PartitionWriteFailed(reason)

    def _close_quietly(self, producer: Producer) -> None:
        # close() aborts a transaction an error left open; on a fenced producer it raises instead.
        try:
            with warnings.catch_warnings():
                # A failed abort inside close() is reported as a warning: the retry's fencing settles it.
                warnings.simplefilter("ignore", RuntimeWarning)
                producer.close()
        except KafkaException as exc:
            log.info("closing the producer of write %s partition %d: %s", self.options.write_id, self.partition,
                     kafka_errors.describe(exc))

    def _abort_quietly(self, producer: Producer) -> None:
        # Leaving the transaction open would hold back every read_committed reader of these partitions
        # until the retry fences it (or the transaction times out); a fenced producer cannot abort.
        try:
            producer.abort_transaction(_CALL_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("abort of write %s partition %d failed: %s", self.options.write_id, self.partition,
                        kafka_errors.describe(exc))


# ---- driver side ---------------------------------------------------------------------------------


def prepare_write(options: WriterOptions) -> Manifest | None:
    """Driver, before any task: make sure the marker topic exists; the manifest if the write id completed.

    With a known partition count, the first run records it (the plan) and a later run with another
    count is refused before it writes anything.
    """
    markers = MarkerTopic(options.kafka, options.marker_topic)
    markers.ensure(options.marker_topic_partitions)
    found = markers.read([manifest_key(options.write_id), plan_key(options.write_id)])
    manifest = found.get(manifest_key(options.write_id))
    plan = found.get(plan_key(options.write_id))
    known = [(name, r.num_partitions) for name, r in (("completed", manifest), ("started", plan))
             if isinstance(r, (Manifest, Plan))]
    if options.num_partitions:
        for name, count in known:
            if count != options.num_partitions:
                raise WriteRefused(
                    f"write {options.write_id!r} was {name} with {count} partitions; this job has "
                    f"{options.num_partitions}: the partitioning changed (use a new write id for new data)"
                )
        if plan is None and manifest is None:
            markers.put(plan_key(options.write_id), Plan(options.write_id, options.num_partitions).to_bytes())
    return manifest if isinstance(manifest, Manifest) else None


def complete_write(
    options: WriterOptions, messages: list[PartitionCommit | None], manifest: Manifest | None
) -> Manifest:
    """Driver, after every task succeeded: check the partitions add up and write the manifest once."""
    commits = [m for m in messages if m is not None]
    if len(commits) != len(messages):
        raise PartitionWriteFailed(f"{len(messages) - len(commits)} task(s) reported no commit message")
    by_partition = {c.partition: c for c in commits}
    count = len(messages)
    if sorted(by_partition) != list(range(count)):
        raise PartitionWriteFailed(f"commit messages cover partitions {sorted(by_partition)}, expected 0..{count - 1}")
    if manifest is not None:
        if manifest.num_partitions != count:
            raise WriteRefused(
                f"write {options.write_id!r} completed with {manifest.num_partitions} partitions; this job had "
                f"{count}: the partitioning changed"
            )
        log.info("write %s was already complete (%d rows); this run wrote nothing", options.write_id, manifest.rows)
        return manifest
    markers = MarkerTopic(options.kafka, options.marker_topic)
    plan = markers.read([plan_key(options.write_id)]).get(plan_key(options.write_id))
    if isinstance(plan, Plan) and plan.num_partitions != count:
        raise WriteRefused(
            f"write {options.write_id!r} was started with {plan.num_partitions} partitions; this job had {count}"
        )
    parts = {
        c.partition: PartitionMarker(
            write_id=options.write_id, partition=c.partition, rows=c.rows, fingerprint=c.fingerprint,
            chunks=c.chunks, done=True, attempt=c.attempt, num_partitions=count,
            rows_written=c.rows_written,
        )
        for c in commits
    }
    done = Manifest(
        write_id=options.write_id, num_partitions=count, rows=sum(c.rows for c in commits), partitions=parts,
        completed_at_ms=int(time.time() * 1000),
    )
    markers.put(manifest_key(options.write_id), done.to_bytes())
    log.info("write %s complete: %d rows in %d partitions, %d written by this run",
             options.write_id, done.rows, count, done.rows_written)
    return done


def write_partition(
    options: WriterOptions,
    batches: Iterable[pa.RecordBatch],
    *,
    partition: int,
    attempt: int,
    manifest: Manifest | None = None,
    transaction_scope: str | None = None,
) -> PartitionCommit:
    """Write one Spark partition's rows (what a task does; callable directly to model concurrent attempts).

    The batch writer and the stream writer both call it: `options.write_id` names the rows (rk-ids,
    markers), `transaction_scope` (default: the write id) names the exactly_once transactional.id.
    With an OpenTelemetry SDK in the worker, the task is a `send` span whose context every row carries.
    """
    if not telemetry.tracing_enabled():
        return _write_partition(options, batches, partition, attempt, manifest, transaction_scope)
    with telemetry.batch_send_span(options.topic, **{
        "reliable_kafka.write_id": options.write_id, "reliable_kafka.guarantee": options.guarantee,
        "reliable_kafka.spark.partition": partition, "reliable_kafka.spark.attempt": attempt,
    }):
        return _write_partition(options, batches, partition, attempt, manifest, transaction_scope)


def _write_partition(options: WriterOptions, batches: Iterable[pa.RecordBatch], partition: int, attempt: int,
                     manifest: Manifest | None, transaction_scope: str | None) -> PartitionCommit:
    if options.guarantee == AT_LEAST_ONCE:
        return _write_at_least_once(options, batches, partition, attempt)
    return _ExactlyOnce(options, partition, attempt, transaction_scope).run(batches, manifest)


def current_task() -> Any:
    """The running Spark task's TaskContext (its partition, attempt and local properties)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        raise PartitionWriteFailed("write() runs inside a Spark task; call write_partition() elsewhere")
    return context


class KafkaArrowWriter(DataSourceArrowWriter):
    """The DataSourceArrowWriter Spark runs: Arrow batches in, one PartitionCommit per task out."""

    def __init__(self, options: WriterOptions, manifest: Manifest | None) -> None:
        self.options = options
        self.manifest = manifest

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PartitionCommit:
        context = current_task()
        return write_partition(
            self.options, iterator, partition=context.partitionId(), attempt=context.attemptNumber(),
            manifest=self.manifest,
        )

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        commits = [m if isinstance(m, PartitionCommit) else None for m in messages]
        if self.options.guarantee == EXACTLY_ONCE:
            complete_write(self.options, commits, self.manifest)
        else:
            rows = sum(c.rows for c in commits if c is not None)
            log.info("write %s (at_least_once) delivered %d rows in %d partitions", self.options.write_id,
                     rows, len(commits))

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        done = [m for m in messages if isinstance(m, PartitionCommit)]
        log.warning(
            "write %s failed; %d partition(s) had finished. %s", self.options.write_id, len(done),
            "Run the job again with the same write id: committed partitions and chunks are skipped."
            if self.options.guarantee == EXACTLY_ONCE
            else "at_least_once: a re-run writes every row again (same rk-ids when the write id is kept).",
        )

