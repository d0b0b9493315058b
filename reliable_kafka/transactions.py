"""TransactionalProcessor: exactly-once consume-transform-produce from Kafka topics to Kafka topics.

Guarantee: the outputs of a batch and the offsets of the inputs that produced them commit in one Kafka
transaction, so through crashes, rebalances and broker failures every input record's outputs (or its
dead-letter copy) become visible to read_committed readers exactly once.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, TypeAlias, TypeVar, cast

from confluent_kafka import (
    OFFSET_BEGINNING,
    OFFSET_END,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from reliable_kafka import kafka_errors, telemetry
from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.config import consumer_config, transactional_producer_config
from reliable_kafka.dlq import DEFAULT_DLQ_TEMPLATE, dead_letter_headers, dlq_topic_for
from reliable_kafka.errors import (
    ConfigError,
    DeadLetterFailed,
    ReliableKafkaError,
    RetriesExhausted,
    RetryInterrupted,
    TransactionFailed,
    TransactionFenced,
)
from reliable_kafka.ids import ID_HEADER, message_id_of
from reliable_kafka.kafka_errors import Disposition
from reliable_kafka.retry import RetryPolicy, retry_kafka_call

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("reliable_kafka.rdkafka")

T = TypeVar("T")
TopicPartitionKey = tuple[str, int]
HeaderValue = str | bytes | None
OutputHeaders = Sequence[tuple[str, HeaderValue]] | Mapping[str, HeaderValue]

# How long consume() blocks while no transaction is open: bounds how late stop() is noticed.
_IDLE_POLL_S = 0.1
# How long consume() blocks while a commit runs in the background: how soon its end is noticed.
_COMMIT_CHECK_S = 0.01
# Records asked from librdkafka per consume() call; a transaction may span several calls.
_CONSUME_CHUNK = 500
# A transform is retried while its transaction stays open and every partition waits: briefly, by default.
DEFAULT_RETRY_POLICY = RetryPolicy(attempts=3, initial_backoff_s=0.1, max_backoff_s=1.0)
# Failed transactions in a row: the pause before the next try doubles from _BACKOFF_FIRST_S up to
# _BACKOFF_MAX_S, and this many failures in a row stop the instance.
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0
_MAX_FAILED_IN_A_ROW = 10
# The shortest timeout a transactional call gets when a graceful stop is nearly out of time.
_MIN_CALL_S = 1.0


@dataclass(slots=True)
class OutputRecord:
    """A record `transform` wants written, in the same transaction as the input that produced it.

    Without an `rk-id` header of its own it gets a deterministic one, "<input rk-id>:<index>" (or
    "<topic>/<partition>/<offset>:<index>" for an input without rk-id), so a downstream dedup can
    recognise it whatever happens upstream.
    """

    topic: str
    value: bytes | None
    key: bytes | None = None
    headers: OutputHeaders | None = None
    partition: int | None = None


Transform = Callable[[Message], Iterable[OutputRecord]]
Outputs = Sequence[OutputRecord]
# One output, ready for produce(): topic, value, key, partition (-1: the partitioner's choice), headers
# (with the rk-id), and the input it came from (partition, offset, dead-lettered or not). Headers are
# kept as a tuple of pairs, or as the rk-id alone (a str) for an output without headers of its own,
# and made a list (what produce() takes) only when written: a tuple of atoms is one the garbage
# collector stops tracking, while a list would keep it tracked as long as it waits behind a commit.
_OutHeaders: TypeAlias = "str | tuple[tuple[str, HeaderValue], ...]"
_Out = tuple[str, "bytes | None", "bytes | None", int, _OutHeaders, TopicPartitionKey, int, bool]


def _out_headers(out: _Out) -> list[tuple[str, HeaderValue]]:
    headers = out[4]
    return [(ID_HEADER, headers)] if headers.__class__ is str else list(headers)  # type: ignore[arg-type]


class _Batch:
    """Processed input records, flattened to what the transaction needs: their outputs and offsets.

    Records processed while a commit runs wait in one of these (the backlog, up to max_batch_messages
    records) for the next transaction. They are held flat (one tuple of atoms per output, which the
    collector stops tracking at its first pass) rather than as the consumed Messages, the transform's
    OutputRecords and a tuple per record: with tens of thousands of records waiting, the cyclic garbage
    collector's full passes over ~5 objects per record cost about a third of the copy's throughput on
    the benchmark host (0.77 s of a 3.6 s copy).
    """

    __slots__ = ("outputs", "offsets", "messages", "dead")

    def __init__(self) -> None:
        self.outputs: list[_Out] = []
        self.offsets: dict[TopicPartitionKey, int] = {}  # next offset to consume, per input partition
        self.messages = 0
        self.dead = 0

    def extend(self, later: _Batch) -> None:
        self.outputs.extend(later.outputs)
        self.offsets.update(later.offsets)  # a later batch's offsets are higher
        self.messages += later.messages
        self.dead += later.dead

    def clear(self) -> None:
        self.outputs = []
        self.offsets = {}
        self.messages = self.dead = 0


@dataclass(frozen=True)
class CommitInfo:
    """What one committed transaction contained (passed to `on_commit`)."""

    offsets: dict[TopicPartitionKey, int]  # next offset to consume per input partition, as committed
    messages: int  # input records whose offsets this transaction committed
    outputs: int  # output records written, dead-letter records included
    dead_lettered: int


@dataclass
class ProcessorStats:
    """Counters since the processor was created (stats() hands out a copy)."""

    transactions_committed: int = 0
    transactions_aborted: int = 0
    messages_committed: int = 0
    outputs_committed: int = 0
    dead_lettered: int = 0
    producer_recreations: int = 0
    rewinds: int = 0


class TxnStep(enum.Enum):
    """What the processor does after a transactional call failed; decided by `next_step` only."""

    RETRY = "retry"  # call again (with backoff) until the retry deadline
    ABORT = "abort"  # abort the transaction, rewind the consumer to its committed offsets, go on
    RECREATE = "recreate"  # outcome unknown: a new producer settles the old transaction; then rewind
    STOP = "stop"  # fenced or fatal: this instance stops with TransactionFenced / TransactionFailed


def next_step(operation: str, error: KafkaError | KafkaException) -> TxnStep:
    """The one place that decides what an error of a transactional operation means.

    `operation` is the producer call that failed ("init_transactions", "begin_transaction",
    "produce", "send_offsets_to_transaction", "commit_transaction", "abort_transaction") or
    "consume". Built on `kafka_errors.classify`, so librdkafka's own flags come first: fatal() stops,
    txn_requires_abort() aborts.
    """
    if operation == "produce":
        # produce() refused a record: the transaction is incomplete. A fatal producer state shows up
        # here only as _FATAL; the abort that follows reports its real reason (e.g. fenced).
        return TxnStep.ABORT
    disposition = kafka_errors.classify(error)
    if kafka_errors.epoch_bumped(error):
        # The epoch moved on without a newer instance saying so (a takeover answers PRODUCER_FENCED):
        # a new producer takes the current epoch, settles the old transaction and the instance goes on,
        # as Kafka Streams does. The processor stops instead if its consumer no longer owns partitions
        # (a zombie), and the failures-in-a-row limit bounds a fence that keeps coming back.
        return TxnStep.RECREATE
    if operation == "abort_transaction" and disposition is Disposition.FATAL and not kafka_errors.is_fenced(error):
        # Seen under load: an abort right after an output was refused answered INVALID_TXN_STATE,
        # fatal to this producer only. Nothing newer owns the transactional.id, so a new producer's
        # init_transactions settles the old transaction and the instance goes on (bounded by the
        # failures-in-a-row limit, should it recur).
        return TxnStep.RECREATE
    if disposition is Disposition.FATAL:
        return TxnStep.STOP
    if operation == "abort_transaction":
        # An abort that cannot complete is settled by a new producer: its init_transactions aborts
        # whatever the old epoch left open.
        return TxnStep.RETRY if _retriable(error, disposition) else TxnStep.RECREATE
    if disposition is Disposition.ABORTABLE:
        return TxnStep.ABORT
    if operation == "commit_transaction" and kafka_errors.outcome_unknown(error):
        # EndTxn may or may not have landed. Jepsen showed that a client which moves on from here can
        # see a late EndTxn, or late records of the old transaction, slip into its next transaction
        # (KIP-890 closes this on the broker; librdkafka does not implement it). A new producer bumps
        # the epoch: the coordinator completes or aborts the old transaction and fences every request
        # still in flight from it; the committed offsets then say which of the two happened.
        return TxnStep.RECREATE
    if _retriable(error, disposition):
        return TxnStep.RETRY
    # A permanent error librdkafka did not flag as abortable: the transaction cannot be trusted.
    return TxnStep.ABORT


def _retriable(error: KafkaError | KafkaException, disposition: Disposition) -> bool:
    inner = error.args[0] if isinstance(error, KafkaException) and error.args else error
    flagged = isinstance(inner, KafkaError) and inner.retriable()
    return flagged or disposition in (Disposition.RETRIABLE, Disposition.COORDINATOR)


class _TxnError(Exception):
    """Internal: a transactional call failed for good; `step` says how to recover."""

    def __init__(self, operation: str, step: TxnStep, error: KafkaException) -> None:
        self.operation = operation
        self.step = step
        self.error = error
        super().__init__(f"{operation}: {kafka_errors.describe(error)} -> {step.value}")


class _Rewound(Exception):
    """Internal: the transaction was aborted and the consumer rewound; drop the rest of this batch."""


class TransactionalProcessor:
    """Consumes `input_topics` in a consumer group, transforms each record, and commits the outputs
    together with the consumed offsets in one transaction per batch.

    A batch closes after `max_batch_messages` records or `max_batch_interval_s` seconds (100 ms by
    default), whichever comes first. While a batch commits, the next one is already consumed and
    transformed; its outputs are written once the commit is through. Outputs carry a deterministic
    `rk-id`. A record whose transform keeps failing (per `retry_policy`) is written to its dead-letter
    topic (`dlq_topic`, default "<topic>.dlq", which must exist) inside the same transaction, and
    processing goes on.

    `transactional_id` must be stable for this instance and unique among live instances (e.g.
    "<app>-<pod ordinal>"): a restart with the same id fences its previous incarnation and aborts
    what it left open. Zombies that lost their partitions are fenced through the consumer group's
    metadata (KIP-447, brokers >= 2.5), so the id need not follow partition assignment.

    Use as a context manager: `with TransactionalProcessor(...) as p: p.run()`. `stop()` (safe from
    a signal handler) makes run() commit what is processed and return. Fatal errors stop the
    instance: TransactionFenced when another instance took over, TransactionFailed otherwise.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        group_id: str,
        input_topics: Sequence[str],
        transform: Transform,
        transactional_id: str,
        consumer_overrides: Mapping[str, Any] | None = None,
        producer_overrides: Mapping[str, Any] | None = None,
        max_batch_messages: int = 20_000,
        max_batch_interval_s: float = 0.1,
        retry_policy: RetryPolicy | None = None,
        dlq_topic: str = DEFAULT_DLQ_TEMPLATE,
        operation_timeout_s: float = 30.0,
        stop_timeout_s: float = 45.0,
        on_commit: Callable[[CommitInfo], None] | None = None,
    ) -> None:
        """Validate the settings; nothing connects until start() (or run(), or `with`).

        `config` holds settings shared by the consumer and the producer (bootstrap.servers, security);
        `consumer_overrides` / `producer_overrides` hold settings for one of them only. Unsafe
        settings (auto-commit, read_uncommitted, acks other than all, ...) raise ConfigError.
        `operation_timeout_s` bounds each transactional call; retriable failures are retried for up to
        twice that. `stop_timeout_s` bounds a graceful stop: what cannot be committed by then (a
        coordinator still moving, say) is given up, never lost: its input offsets stay uncommitted and the
        next owner processes those records again. `retry_policy` retries a failing transform
        (default: 3 attempts, 0.1-1 s apart) before its record is dead-lettered. `on_commit` is called
        after each committed transaction, in the run() thread.
        """
        if isinstance(input_topics, str) or not input_topics:
            raise ConfigError("input_topics", "must be a non-empty list of topic names")
        for key in ("group.id", "transactional.id", "enable.auto.commit", "isolation.level"):
            if key in config:
                raise ConfigError(key, "is the processor's to set (group_id/transactional_id are arguments)")
        if not isinstance(max_batch_messages, int) or max_batch_messages < 1:
            raise ConfigError("max_batch_messages", f"must be an integer >= 1, got {max_batch_messages!r}")
        if not max_batch_interval_s > 0:
            raise ConfigError("max_batch_interval_s", f"must be > 0, got {max_batch_interval_s!r}")
        if not operation_timeout_s > 0:
            raise ConfigError("operation_timeout_s", f"must be > 0, got {operation_timeout_s!r}")
        if not stop_timeout_s > 0:
            raise ConfigError("stop_timeout_s", f"must be > 0, got {stop_timeout_s!r}")
        common = dict(config)
        self._consumer_conf = consumer_config(
            {**common, "group.id": group_id, **dict(consumer_overrides or {})}
        )
        self._producer_conf = transactional_producer_config(
            {**common, **dict(producer_overrides or {})}, transactional_id
        )
        self._consumer_conf.setdefault("logger", _rdkafka_log)
        self._producer_conf.setdefault("logger", _rdkafka_log)
        reset = str(self._consumer_conf["auto.offset.reset"]).lower()
        # Where a rewind goes for a partition that has no committed offset yet.
        self._reset_to = OFFSET_END if reset in ("latest", "largest", "end") else OFFSET_BEGINNING
        self._input_topics = list(input_topics)
        self._transform = transform
        self._group_id = group_id
        # Looked up once: with no OpenTelemetry SDK installed the hot path stays free of span calls.
        self._tracing = telemetry.tracing_enabled()
        self._transactional_id = transactional_id
        self._max_batch = max_batch_messages
        self._interval = max_batch_interval_s
        self._retry_policy = retry_policy if retry_policy is not None else DEFAULT_RETRY_POLICY
        self._dlq_template = dlq_topic
        self._dlq_topics = {t: dlq_topic_for(t, dlq_topic) for t in self._input_topics}
        self._op_timeout = operation_timeout_s
        self._retry_deadline = 2 * operation_timeout_s
        self._stop_timeout = stop_timeout_s
        # Set when a graceful stop begins: every transactional call after it shares this deadline.
        self._stop_by: float | None = None
        # The thread inside run(), so that close() from another thread stops it before tearing down.
        self._runner: threading.Thread | None = None
        self._on_commit = on_commit

        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._committer: _Committer | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._broken: ReliableKafkaError | None = None
        self._failed_in_a_row = 0
        self._counts = ProcessorStats()
        # Partitions assigned to us right now, and per partition the next offset to process.
        self._owned: set[TopicPartitionKey] = set()
        self._positions: dict[TopicPartitionKey, int] = {}
        # Inputs whose outputs Kafka refused for good: dead-lettered when they come round again.
        self._poison: dict[tuple[str, int, int], tuple[BaseException, int]] = {}
        # The open transaction: what has been written into it so far.
        self._txn_open = False
        self._txn_deadline = 0.0
        self._txn_offsets: dict[TopicPartitionKey, int] = {}
        self._txn_messages = 0
        self._txn_outputs = 0
        self._txn_dead = 0
        # The transaction being committed in the background, what it holds, and whether it is over
        # (a plain flag the committer sets: cheaper to read per record than Future.done()).
        self._committing: tuple[Future[None], CommitInfo] | None = None
        self._commit_over = False
        # Records processed while a commit was running, to be written into the next transaction.
        self._backlog = _Batch()
        self._backlog_since = 0.0
        # When the loop must next look at the clock: a transaction due, or a commit maybe through.
        self._next_check = 0.0

    # ---- public API --------------------------------------------------------------------------

    def start(self) -> TransactionalProcessor:
        """Initialise the transactional producer and join the consumer group (idempotent)."""
        if self._closed:
            raise TransactionFailed("this TransactionalProcessor was closed; create a new one")
        if self._broken is not None:
            raise self._broken
        if self._consumer is not None:
            return self
        # The producer first: init_transactions fences an earlier incarnation of this transactional.id
        # and aborts what it left open, so the committed offsets the consumer reads next are settled.
        self._producer = self._new_producer()
        self._committer = _Committer(f"rk-txn-commit-{self._transactional_id}")
        consumer = Consumer(self._consumer_conf)
        consumer.subscribe(
            self._input_topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        self._consumer = consumer
        log.info("transactional processor %r started on %s", self._transactional_id, self._input_topics)
        return self

    def run(self) -> ProcessorStats:
        """Process records until stop() is called, then commit what is processed and return the stats.

        Raises TransactionFenced (another instance with the same transactional.id took over),
        TransactionFailed (a fatal error) or DeadLetterFailed (a poison record could not be parked);
        in each case nothing of the open transaction becomes visible.
        """
        self.start()
        self._runner = threading.current_thread()
        try:
            try:
                while not self._stopping.is_set():
                    self._poll_once()
            except RetryInterrupted as exc:
                # stop() came while a transform waited to retry: that record stays unprocessed (and
                # uncommitted); what was finished before it is committed below.
                log.info("stopped while retrying a transform: %s", exc)
            self.stop()  # starts the stop's clock if the loop ended some other way
            self._settle("stop requested")
        finally:
            self._runner = None
        return self.stats()

    def stop(self) -> None:
        """Ask run() to commit what is processed and return within stop_timeout_s. Safe from signal
        handlers and threads."""
        if self._stop_by is None:
            self._stop_by = time.monotonic() + self._stop_timeout
        self._stopping.set()

    def close(self) -> None:
        """Leave the consumer group and release the clients.

        A commit already under way is completed; the open transaction is aborted and its records are
        processed again by the next owner. Call stop() and let run() return to commit them instead.
        """
        if self._closed:
            return
        runner = self._runner
        if runner is not None and runner is not threading.current_thread():
            # run() is active in another thread: tearing the clients down under it could leave a
            # transaction open (holding back read_committed readers). Stop it first; its stop is bounded.
            self.stop()
            runner.join(self._stop_timeout + self._op_timeout)
            if runner.is_alive():
                log.warning("run() did not return within %.0fs of stop(); closing anyway",
                            self._stop_timeout + self._op_timeout)
        self._closed = True
        self.stop()
        try:
            self._backlog.clear()
            if self._committing is not None and self._broken is None:
                with contextlib.suppress(ReliableKafkaError, _Rewound):
                    self._reap_commit(wait=True)
            if self._txn_open and self._broken is None and self._producer is not None:
                self._txn_open = False
                try:
                    self._producer.abort_transaction(self._timeout())
                except KafkaException as exc:  # the coordinator aborts it after transaction.timeout.ms
                    log.warning("abort on close failed: %s", kafka_errors.describe(exc))
        finally:
            self._clear_txn()
            consumer, self._consumer = self._consumer, None
            if consumer is not None:
                consumer.close()  # leaves the group; nothing is left to commit on revoke
            if self._committer is not None:
                # A commit given up by an overdue stop may still be inside librdkafka: not waited for.
                self._committer.shutdown(timeout=self._op_timeout if self._stop_by is None else _MIN_CALL_S)
            self._producer = None

    def stats(self) -> ProcessorStats:
        """A snapshot of the counters."""
        return replace(self._counts)

    @property
    def transactional_id(self) -> str:
        return self._transactional_id

    def __enter__(self) -> TransactionalProcessor:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- the loop ----------------------------------------------------------------------------

    def _poll_once(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        with contextlib.suppress(_Rewound):  # after a rewind the records at hand are stale
            if self._committing is not None:
                # The backlog is bounded by the batch size: when it is full, wait for the commit.
                self._reap_commit(wait=self._backlog.messages >= self._max_batch)
            if self._committing is not None:
                # Look again soon: the backlog is written as soon as the commit is through.
                wait, room = _COMMIT_CHECK_S, self._max_batch - self._backlog.messages
            elif self._txn_open:
                wait = max(0.0, self._txn_deadline - time.monotonic())
                room = self._max_batch - self._txn_messages
            else:
                wait, room = _IDLE_POLL_S, self._max_batch
            # A rebalance callback inside consume() may seek (a rewind) or reassign: librdkafka drops the
            # records it had fetched before that (its version barrier), so what comes back is current.
            msgs = consumer.consume(num_messages=max(1, min(room, _CONSUME_CHUNK)), timeout=wait)
            if msgs:
                self._process_batch(msgs)
            else:
                self._hand_over(_Batch())
            if self._committing is None and self._txn_open:
                assert self._producer is not None
                self._producer.poll(0)  # serve delivery reports so they do not pile up

    def _process_batch(self, msgs: list[Message]) -> None:
        # The per-record hot path: plain locals, no helper calls unless something is unusual. Processed
        # records are handed over (written, or queued behind a running commit) in bulk, at the end of the
        # batch or when a deadline passes (a slow transform can make one batch outlast the interval).
        owned, positions, now = self._owned, self._positions, time.monotonic
        transform = self._transform_traced if self._tracing else self._transform
        batch = _Batch()
        flat, offsets = batch.outputs, batch.offsets
        handled = dead_lettered = 0
        for msg in msgs:
            error = msg.error()
            if error is not None:
                self._consumer_error(error)
                continue
            # A consumed record always has topic, partition and offset (cast() would cost a call each).
            key: TopicPartitionKey = (msg.topic(), msg.partition())  # type: ignore[assignment]
            offset: int = msg.offset()  # type: ignore[assignment]
            if key not in owned:
                continue  # fetched before its partition was revoked
            expected = positions.get(key)
            if expected is not None and offset < expected:
                continue  # fetched before a rewind, or processed already
            refused = self._poison.pop((key[0], key[1], offset), None) if self._poison else None
            outputs: Outputs
            if refused is not None:
                outputs, dead = [self._dead_letter(msg, *refused)], True
            else:
                try:
                    outputs = transform(msg)  # type: ignore[assignment]  # made a Sequence just below
                    if outputs.__class__ is not list and outputs.__class__ is not tuple:
                        outputs = list(outputs)  # a generator, say: run it now, inside the try
                    for out in outputs:
                        if out.__class__ is not OutputRecord:
                            _check_output(out)
                    dead = False
                except Exception as first:
                    outputs, dead = self._after_failure(msg, first)
            positions[key] = offset + 1
            # Each output gets its rk-id now, while the input is at hand: "<input rk-id>:<index>".
            base: str | None = None
            index = 0
            headers: str | tuple[tuple[str, HeaderValue], ...]
            for out in outputs:
                if out.headers is None:
                    if base is None:
                        base = _input_id(msg, key, offset)
                    headers = f"{base}:{index}"  # the rk-id alone: the header list is made at produce()
                else:
                    given = out.headers if out.headers.__class__ is list else _header_list(out.headers)
                    if _has_id(given):  # the caller's id is kept
                        headers = tuple(given)
                    else:
                        base = base or _input_id(msg, key, offset)
                        headers = (*given, (ID_HEADER, f"{base}:{index}"))
                flat.append((out.topic, out.value, out.key, -1 if out.partition is None else out.partition,
                             headers, key, offset, dead))
                index += 1  # noqa: SIM113 - enumerate() would cost a tuple per output
            offsets[key] = offset + 1
            handled += 1
            if dead:
                dead_lettered += 1
            if now() >= self._next_check:
                batch.messages, batch.dead = handled, dead_lettered
                self._hand_over(batch)
                batch = _Batch()
                flat, offsets = batch.outputs, batch.offsets
                handled = dead_lettered = 0
        batch.messages, batch.dead = handled, dead_lettered
        self._hand_over(batch)

    def _transform_traced(self, msg: Message) -> Outputs:
        """transform() inside a `process` span linked to the input's producer; its outputs carry the
        span's context (replacing a trace context copied from the input), so their consumers link to it."""
        with telemetry.process_span(msg, self._group_id):
            outputs = list(self._transform(msg))
            carrier = telemetry.context_headers()
        if not carrier:
            return outputs
        traced: list[OutputRecord] = []
        for out in outputs:
            if out.__class__ is not OutputRecord:
                _check_output(out)
            kept = [(k, v) for k, v in _header_list(out.headers) if k not in telemetry.CONTEXT_HEADERS]
            traced.append(replace(out, headers=[*kept, *carrier]))
        return traced

    def _hand_over(self, batch: _Batch) -> None:
        """Write processed records into the open transaction, or queue them while a commit runs; reap a
        finished commit; start a commit when the batch is due. Sets when to look again."""
        if self._committing is not None and (self._commit_over or self._backlog.messages >= self._max_batch):
            self._reap_commit(wait=True)  # through (or the backlog is full): the backlog goes in first
        now = time.monotonic()
        if self._committing is None:
            self._write_all(batch)
            if self._txn_open and (self._txn_messages >= self._max_batch or now >= self._txn_deadline):
                self._start_commit()
        elif batch.messages:
            if not self._backlog.messages:
                self._backlog_since = now
            self._backlog.extend(batch)
        if self._committing is not None:
            self._next_check = now + _COMMIT_CHECK_S
        else:
            self._next_check = self._txn_deadline if self._txn_open else now + self._interval

    def _after_failure(self, msg: Message, first: Exception) -> tuple[Outputs, bool]:
        """Retry a failed transform per the retry policy; a poison record becomes its dead-letter record.

        Only a failure pays for the retry machinery: the policy's first attempt re-raises `first`, so
        the transform still runs at most `attempts` times in all.
        """
        pending: list[BaseException] = [first]

        def attempt() -> list[OutputRecord]:
            if pending:
                raise pending.pop()
            outputs = list(self._transform(msg))
            for out in outputs:
                _check_output(out)
            return outputs

        try:
            return self._retry_policy.run(attempt, stop_event=self._stopping, label=_label(msg)), False
        except RetriesExhausted as exc:
            log.error("%s is poison after %d attempt(s): %r; dead-lettering it",
                      _label(msg), exc.attempts, exc.last_error)
            return [self._dead_letter(msg, exc.last_error, exc.attempts)], True

    def _dead_letter(self, msg: Message, error: BaseException, attempts: int) -> OutputRecord:
        topic, partition, offset = _where(msg)
        dlq = self._dlq_topics.get(topic)
        if dlq is None:
            dlq = self._dlq_topics[topic] = dlq_topic_for(topic, self._dlq_template)
        original = _input_headers(msg)
        if not _has_id(original):
            original.append((ID_HEADER, _input_id(msg, (topic, partition), offset).encode()))
        kind, stamp = msg.timestamp()
        headers = dead_letter_headers(
            topic=topic,
            partition=partition,
            offset=offset,
            timestamp_ms=stamp if kind else None,
            error=error,
            attempts=attempts,
            original_headers=original,
        )
        return OutputRecord(dlq, msg.value(), msg.key(), headers)

    def _write_all(self, batch: _Batch, opened_at: float | None = None) -> None:
        """Produce processed records' outputs into the open transaction (opening it) and stage their
        offsets. One loop for many records: the per-record cost is what the benchmark measures."""
        if not batch.messages:
            return
        if not self._txn_open:
            self._begin(opened_at)
        producer = self._producer
        assert producer is not None
        produce = producer.produce
        for out in batch.outputs:
            topic, value, key, partition, headers = out[0], out[1], out[2], out[3], out[4]
            try:
                try:
                    # Positional, as in ReliableProducer._produce: keywords cost ~1 µs a call.
                    produce(topic, value, key, partition, None, None, 0,
                            [(ID_HEADER, headers)] if headers.__class__ is str else list(headers))  # type: ignore[arg-type]
                except BufferError:
                    # Bounded by message.timeout.ms: then queued records fail, which frees room, and
                    # the commit aborts.
                    produce_when_room(producer, topic, value, key, partition, None, None, 0, _out_headers(out))
            except KafkaException as exc:
                self._output_refused(out, exc)
        self._txn_offsets.update(batch.offsets)
        self._txn_messages += batch.messages
        self._txn_outputs += len(batch.outputs)
        self._txn_dead += batch.dead

    def _output_refused(self, out: _Out, exc: KafkaException) -> None:
        """produce() refused an output: abort; dead-letter the input if Kafka will never take the output."""
        topic, (in_topic, in_partition), in_offset, dead = out[0], out[5], out[6], out[7]
        where = (in_topic, in_partition, in_offset)
        label = f"{in_topic}[{in_partition}]@{in_offset}"
        if kafka_errors.classify(exc) is Disposition.PERMANENT:
            if dead:
                self._recover(_TxnError("produce", TxnStep.ABORT, exc))
                self._broken = DeadLetterFailed(
                    f"{label} could not be written to dead-letter topic {topic!r}: "
                    f"{kafka_errors.describe(exc)}; its offset was not committed"
                )
                raise self._broken from exc
            # Some outputs of this input may already be in the transaction: abort it all, and on the
            # way round again park the input on its dead-letter topic instead of transforming it.
            self._poison[where] = (exc, 1)
            log.error("%s: output to %r refused for good (%s); the input will be dead-lettered",
                      label, topic, kafka_errors.describe(exc))
        self._recover(_TxnError("produce", next_step("produce", exc), exc))
        raise _Rewound

    def _consumer_error(self, error: KafkaError) -> None:
        if error.fatal():
            raise self._stop_with(_TxnError("consume", TxnStep.STOP, KafkaException(error)))
        log.warning("consumer error: %s", kafka_errors.describe(error))

    # ---- transactions ------------------------------------------------------------------------

    def _begin(self, opened_at: float | None = None) -> None:
        producer = self._producer
        assert producer is not None
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            # begin only fails when the producer's state is off: start again from a fresh one.
            fatal = next_step("begin_transaction", exc) is TxnStep.STOP
            self._recover(_TxnError("begin_transaction", TxnStep.STOP if fatal else TxnStep.RECREATE, exc))
            raise _Rewound from exc
        self._txn_open = True
        self._txn_deadline = (time.monotonic() if opened_at is None else opened_at) + self._interval

    def _start_commit(self) -> None:
        """Hand the open transaction to the committer thread; the loop goes on with the next batch."""
        producer, consumer, committer = self._producer, self._consumer, self._committer
        assert producer is not None and consumer is not None and committer is not None
        info = CommitInfo(dict(self._txn_offsets), self._txn_messages, self._txn_outputs, self._txn_dead)
        # Taken now, in the loop's thread: the generation that owns these partitions at this moment.
        metadata = consumer.consumer_group_metadata()
        self._clear_txn()
        self._commit_over = False
        future = committer.submit(self._end_transaction, producer, info.offsets, metadata)
        future.add_done_callback(self._mark_commit_over)
        self._committing = (future, info)

    def _mark_commit_over(self, _future: Future[None]) -> None:
        self._commit_over = True

    def _end_transaction(
        self, producer: Producer, offsets: dict[TopicPartitionKey, int], metadata: Any
    ) -> None:
        """Commit a transaction: its outputs, then its input offsets, then the end marker.

        The order is the point. The outputs were produced first; send_offsets_to_transaction then adds
        the inputs' next offsets (last processed + 1) to the same transaction, tagged with the consumer's
        group metadata, so a zombie whose generation is stale is refused (KIP-447); commit_transaction
        flushes whatever is still in flight and only then ends the transaction. Either all of it becomes
        visible to read_committed readers, or none of it does and the consumer is rewound.
        Runs in the committer thread; raises _TxnError, which the loop handles.
        """
        partitions = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        with telemetry.span("transaction commit", **{"messaging.consumer.group.name": self._group_id,
                                                      "messaging.kafka.transactional_id": self._transactional_id}):
            if partitions:
                self._call(
                    "send_offsets_to_transaction",
                    lambda: producer.send_offsets_to_transaction(partitions, metadata, self._timeout()),
                )
            self._call("commit_transaction", lambda: producer.commit_transaction(self._timeout()))

    def _reap_commit(self, *, wait: bool) -> None:
        """Take the result of the background commit (blocking if `wait`); then write the backlog."""
        if self._committing is None:
            return
        future, info = self._committing
        if not wait and not self._commit_over:
            return
        try:
            if wait and self._stop_by is not None:
                # A commit call cannot be cut short inside librdkafka (a hung coordinator holds it for up
                # to socket.timeout.ms): a stop waits for it only until its own deadline.
                future.result(timeout=max(0.0, self._stop_by - time.monotonic()))
            else:
                future.result()
        except FutureTimeout:
            self._committing = None
            self._abandon("a commit still under way")
            raise _Rewound from None
        except _TxnError as exc:
            self._committing = None
            log.warning("transaction not committed: %s", exc)
            self._recover(exc)
            raise _Rewound from exc
        self._committing = None
        self._failed_in_a_row = 0
        counts = self._counts
        counts.transactions_committed += 1
        counts.messages_committed += info.messages
        counts.outputs_committed += info.outputs
        counts.dead_lettered += info.dead_lettered
        log.debug("committed %d input record(s), %d output(s)", info.messages, info.outputs)
        if self._on_commit is not None:
            self._on_commit(info)
        backlog, self._backlog = self._backlog, _Batch()
        # The batch began with the backlog, not now: the interval counts from its first record.
        self._write_all(backlog, opened_at=self._backlog_since)

    def _settle(self, reason: str) -> None:
        """Commit everything processed so far and wait for it (on stop and before partitions go)."""
        while (self._committing is not None or self._txn_open) and self._broken is None:
            with contextlib.suppress(_Rewound):  # an abort rewinds: nothing is left to commit
                if self._committing is None:
                    if self._overdue():
                        self._abandon(reason)
                        return
                    log.debug("committing before returning (%s)", reason)
                    self._start_commit()
                self._reap_commit(wait=True)

    def _abandon(self, reason: str) -> None:
        """A graceful stop ran out of time: give up the open transaction rather than wait on.

        Nothing is lost: its input offsets were never committed, so the next owner processes its records
        again, and its outputs are aborted (here if the producer still answers, else by the coordinator
        when the next instance with this transactional.id starts, or after transaction.timeout.ms).
        """
        log.warning("%s: the stop ran past stop_timeout_s=%.0fs (%s); giving up the open transaction, whose "
                    "records the next owner processes again", self._transactional_id, self._stop_timeout, reason)
        self._counts.transactions_aborted += 1
        telemetry.transaction_aborts.add(1)
        had_open = self._txn_open
        self._clear_txn()
        self._backlog.clear()
        producer = self._producer
        if had_open and producer is not None:
            with contextlib.suppress(KafkaException):
                producer.abort_transaction(_MIN_CALL_S)

    def _recover(self, exc: _TxnError) -> None:
        """Act on a failed transactional call as next_step() decided.

        A failure that keeps coming back (an output or dead-letter topic that does not exist, say) must
        not spin unseen: each failure in a row waits a little longer, and after _MAX_FAILED_IN_A_ROW the
        instance stops with TransactionFailed. Nothing past the last committed transaction is lost.
        """
        if self._must_stop(exc):
            raise self._stop_with(exc) from exc.error
        if self._overdue():
            self._abandon(str(exc))  # no time left to recreate a producer or to retry
            return
        if exc.step is TxnStep.RECREATE:
            self._recreate_producer(str(exc))
        else:
            self._abort(str(exc))
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= _MAX_FAILED_IN_A_ROW:
            self._broken = TransactionFailed(
                f"transactional.id {self._transactional_id!r}: {self._failed_in_a_row} transactions in a row "
                f"failed, the last with {exc}. Nothing past the last committed transaction was lost; check "
                "that the output and dead-letter topics exist and the brokers are healthy, then restart",
                code=kafka_errors.name_of(exc.error),
            )
            raise self._broken from exc.error
        self._stopping.wait(min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (self._failed_in_a_row - 1)))

    def _must_stop(self, exc: _TxnError) -> bool:
        # An old epoch while owning no partitions is a zombie's fence: a new producer would fence the
        # instance that owns the work now.
        return exc.step is TxnStep.STOP or (kafka_errors.epoch_bumped(exc.error) and not self._owns_partitions())

    def _owns_partitions(self) -> bool:
        consumer = self._consumer
        if consumer is None:
            return False
        try:
            return bool(consumer.assignment())
        except (KafkaException, RuntimeError):  # RuntimeError: the consumer is already closed
            return False

    def _abort(self, reason: str) -> None:
        """Abort the open (or just failed) transaction and rewind the consumer to its committed offsets."""
        producer = self._producer
        assert producer is not None
        self._counts.transactions_aborted += 1
        telemetry.transaction_aborts.add(1)
        self._clear_txn()
        try:
            self._call("abort_transaction", lambda: producer.abort_transaction(self._timeout()))
        except _TxnError as exc:
            if self._must_stop(exc):
                raise self._stop_with(exc) from exc.error
            if self._overdue():
                # No time to start a fresh producer: the coordinator settles the transaction instead.
                log.warning("abort failed while the stop ran out of time (%s); the coordinator aborts it", exc)
                return
            self._recreate_producer(f"abort failed: {exc}", counted=True)
            return
        log.warning("transaction aborted (%s); rewinding to the committed offsets", reason)
        self._rewind()

    def _recreate_producer(self, reason: str, *, counted: bool = False) -> None:
        """Replace the producer: the new one's init_transactions settles whatever the old one left."""
        log.warning("recreating the transactional producer (%s)", reason)
        if not counted:
            self._counts.transactions_aborted += 1
            telemetry.transaction_aborts.add(1)
        self._counts.producer_recreations += 1
        self._clear_txn()
        old, self._producer = self._producer, None
        if old is not None:
            # A producer in a fatal state may refuse to purge; it is dropped either way.
            with contextlib.suppress(KafkaException):
                old.purge(in_queue=True, in_flight=True, blocking=False)
            del old
        self._producer = self._new_producer()
        self._rewind()

    def _new_producer(self) -> Producer:
        producer = Producer(self._producer_conf)
        try:
            self._call("init_transactions", lambda: producer.init_transactions(self._timeout()))
        except _TxnError as exc:
            if exc.step is TxnStep.STOP:
                raise self._stop_with(exc) from exc.error
            self._broken = TransactionFailed(
                f"transactional.id {self._transactional_id!r}: init_transactions did not succeed within "
                f"{self._retry_deadline:.0f}s ({kafka_errors.describe(exc.error)}); is the transaction "
                "coordinator reachable and __transaction_state healthy?",
                code=kafka_errors.name_of(exc.error),
            )
            raise self._broken from exc.error
        return producer

    def _call(self, operation: str, fn: Callable[[], T]) -> T:
        """Run one transactional call; retry it while next_step() says RETRY, else raise _TxnError."""

        def disposition(exc: KafkaException) -> Disposition:
            if self._overdue():
                return Disposition.FATAL  # a graceful stop is out of time: no more retries
            return Disposition.RETRIABLE if next_step(operation, exc) is TxnStep.RETRY else Disposition.FATAL

        try:
            return retry_kafka_call(
                fn,
                deadline_s=self._deadline(),
                what=f"{operation} ({self._transactional_id})",
                classify=disposition,
                retry_on=(Disposition.RETRIABLE,),
                log=log,
            )
        except KafkaException as exc:
            step = next_step(operation, exc)
            if step is TxnStep.RETRY:
                step = TxnStep.RECREATE  # still failing at the deadline: start over from a fresh producer
            raise _TxnError(operation, step, exc) from exc

    def _timeout(self) -> float:
        """One transactional call's timeout: operation_timeout_s, or what is left of a graceful stop."""
        if self._stop_by is None:
            return self._op_timeout
        return max(_MIN_CALL_S, min(self._op_timeout, self._stop_by - time.monotonic()))

    def _deadline(self) -> float:
        """How long a failing call is retried: twice operation_timeout_s, or what is left of a stop."""
        if self._stop_by is None:
            return self._retry_deadline
        return max(_MIN_CALL_S, min(self._retry_deadline, self._stop_by - time.monotonic()))

    def _overdue(self) -> bool:
        return self._stop_by is not None and time.monotonic() >= self._stop_by

    def _clear_txn(self) -> None:
        self._txn_open = False
        self._txn_offsets = {}
        self._txn_messages = self._txn_outputs = self._txn_dead = 0

    def _rewind(self) -> None:
        """Forget all uncommitted work and seek every owned partition back to its committed offset."""
        consumer = self._consumer
        self._counts.rewinds += 1
        self._positions.clear()
        self._backlog.clear()
        if consumer is None or not self._owned:
            return
        if self._stopping.is_set():
            # Stopping: no seek (it could wait on a hung coordinator); instead nothing more is processed
            # here, so no record after the rewound ones can be committed. The next owner starts at the
            # committed offsets.
            self._owned.clear()
            return
        owned = [TopicPartition(t, p) for t, p in sorted(self._owned)]
        try:
            # read_committed makes librdkafka ask for stable offsets (KIP-447): pending transactional
            # offsets are waited for, not skipped.
            committed = retry_kafka_call(
                lambda: consumer.committed(owned, timeout=self._timeout()),
                deadline_s=self._deadline(),
                what="read committed offsets",
                log=log,
            )
        except KafkaException as exc:
            self._broken = TransactionFailed(
                "could not read the committed offsets to rewind after an abort "
                f"({kafka_errors.describe(exc)}); stopping rather than skip or repeat records",
                code=kafka_errors.name_of(exc),
            )
            raise self._broken from exc
        for tp in committed:
            key = (tp.topic, tp.partition)
            if tp.offset >= 0:
                self._positions[key] = tp.offset
                target = tp.offset
            else:
                target = self._reset_to
            try:
                consumer.seek(TopicPartition(tp.topic, tp.partition, target))
            except KafkaException as exc:
                if kafka_errors.code_of(exc) != KafkaError._STATE:
                    raise
                # Not fetching yet: it will start at its committed offset anyway.
                log.debug("%s[%d] not fetching yet; no seek needed", tp.topic, tp.partition)

    def _stop_with(self, exc: _TxnError) -> ReliableKafkaError:
        """The error this instance stops with (also remembered, so close() does not try to commit)."""
        reason = kafka_errors.describe(exc.error)
        error: ReliableKafkaError
        if kafka_errors.is_fenced(exc.error):
            error = TransactionFenced(
                f"transactional.id {self._transactional_id!r} was fenced during {exc.operation} ({reason}): "
                "another instance with the same transactional.id or group.instance.id took over. This "
                "instance stopped; its uncommitted work is aborted and redone by the new owner.",
                code=kafka_errors.name_of(exc.error),
            )
        else:
            error = TransactionFailed(
                f"transactional.id {self._transactional_id!r}: fatal error during {exc.operation} "
                f"({reason}). This instance stopped; its uncommitted work is aborted and redone after a "
                "restart.",
                code=kafka_errors.name_of(exc.error),
            )
        self._broken = error
        self._clear_txn()
        self._backlog.clear()
        return error

    # ---- rebalances --------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # New partitions start at their committed offsets, fetched as stable offsets (KIP-447).
        self._owned.update((tp.topic, tp.partition) for tp in partitions)
        log.info("%s assigned %s", self._transactional_id, _names(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("%s revoked %s", self._transactional_id, _names(partitions))
        if not self._closed:
            # Commit before the partitions are released: the offsets go in under the generation that
            # still owns them, and the next owner starts exactly after what we processed.
            self._settle("partitions revoked")
        self._forget(partitions)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.warning("%s lost %s", self._transactional_id, _names(partitions))
        self._forget(partitions)
        if self._closed or self._broken is not None:
            return
        # Someone else may own them already: their offsets must not be committed by us. A commit
        # already under way is decided by the coordinator (it refuses a stale generation); the open
        # transaction and the backlog go, and the partitions still owned are rewound and done again.
        with contextlib.suppress(_Rewound):
            self._backlog.clear()
            self._reap_commit(wait=True)
            if self._txn_open:
                self._abort("partitions lost")
            else:
                self._rewind()

    def _forget(self, partitions: list[TopicPartition]) -> None:
        gone = {(tp.topic, tp.partition) for tp in partitions}
        self._owned -= gone
        for key in gone:
            self._positions.pop(key, None)
        if self._poison:
            self._poison = {k: v for k, v in self._poison.items() if (k[0], k[1]) not in gone}


class _Committer:
    """One daemon thread that runs commits in order.

    Not a ThreadPoolExecutor: its threads are joined when the interpreter exits, so a commit that a stop
    gave up on, still waiting inside librdkafka on a hung coordinator, would hold up the process's exit.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread with the future
                future.set_exception(exc)

    def shutdown(self, timeout: float) -> None:
        """Let queued commits finish, then end the thread; wait up to `timeout` for that."""
        self._queue.put(None)
        self._thread.join(timeout)


def _where(msg: Message) -> tuple[str, int, int]:
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    assert topic is not None and partition is not None and offset is not None  # a consumed record
    return topic, partition, offset


def _input_headers(msg: Message) -> list[tuple[str, HeaderValue]]:
    return cast(list[tuple[str, HeaderValue]], list(msg.headers() or []))


def _input_id(msg: Message, key: TopicPartitionKey, offset: int) -> str:
    """The input's rk-id, or its coordinates when a foreign producer wrote it."""
    headers = msg.headers()
    found = message_id_of(cast(list[tuple[str, bytes | None]], headers)) if headers else None
    return found if found is not None else f"{key[0]}/{key[1]}/{offset}"


def _check_output(out: object) -> None:
    if not isinstance(out, OutputRecord):
        raise TypeError(f"transform must yield OutputRecord, got {type(out).__name__}")


def _has_id(headers: Sequence[tuple[str, HeaderValue]]) -> bool:
    for name, _ in headers:  # noqa: SIM110 - per record: a plain loop is twice as fast as any() here
        if name == ID_HEADER:
            return True
    return False


def _header_list(headers: OutputHeaders | None) -> list[tuple[str, HeaderValue]]:
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)


def _label(msg: Message) -> str:
    return f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"


def _names(partitions: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"

