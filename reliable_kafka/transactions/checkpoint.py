"""Checkpoint: the open transaction's state (offsets, counts, deadline, backlog) and its steps.

Guarantee: the outputs of processed records and their input offsets commit in one transaction, outputs
first, then offsets, then the end marker; a step that fails aborts (or settles with a new producer) and
rewinds the consumer to the committed offsets, so nothing past the last commit is lost or done twice.
Steps return an Outcome; only the errors this instance stops with are raised.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from reliable_kafka import kafka_errors, telemetry
from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.errors import ReliableKafkaError, TransactionFailed
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.stats import Counters, Stats
from reliable_kafka.transactions.calls import MIN_CALL_S, CallWatch, Deadlines, Failure, call
from reliable_kafka.transactions.client import TransactionalClient
from reliable_kafka.transactions.committer import Committer
from reliable_kafka.transactions.records import (
    OUT_WIDTH,
    Batch,
    HeaderValue,
    Out,
    TopicPartitionKey,
    each_out,
    not_bytes,
)
from reliable_kafka.transactions.rewind import seek_to_committed
from reliable_kafka.transactions.steps import TxnStep, next_step

log = logging.getLogger("reliable_kafka.transactions")

# How soon the loop looks again while a commit runs in the background: how soon its end is noticed.
COMMIT_CHECK_S = 0.01
# While the loop waits for a commit, how often it looks whether the commit's call is hung (CallWatch).
_HUNG_CHECK_S = 1.0
# Failed transactions in a row: the pause before the next try doubles from _BACKOFF_FIRST_S up to
# _BACKOFF_MAX_S, and this many failures in a row stop the instance.
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0
_MAX_FAILED_IN_A_ROW = 10


class _Hung(Exception):  # noqa: N818 - a signal inside reap(), never raised out of it
    def __init__(self, operation: str, reason: str) -> None:
        super().__init__(reason)
        self.operation, self.reason = operation, reason


class Outcome(enum.Enum):
    """What a checkpoint step did."""

    DONE = "done"  # the step went through (or there was nothing to do)
    WAITING = "waiting"  # the commit runs on in the background
    REWOUND = "rewound"  # the transaction was given up and the consumer rewound: records at hand are stale


@dataclass(frozen=True)
class CommitInfo:
    """What one committed transaction contained (passed to `on_commit`)."""

    offsets: dict[TopicPartitionKey, int]  # next offset to consume per input partition, as committed
    messages: int  # input records whose offsets this transaction committed
    outputs: int  # output records written, dead-letter records included
    dead_lettered: int


# What the processor's stats() reports, always all of them (docs/exactly-once.md#stats says what each
# counts). Updated once per commit, abort or rewind, never per record: the Counters' lock costs nothing.
STATS = ("transactions_committed", "transactions_aborted", "messages_committed", "outputs_committed",
         "dead_lettered", "producer_recreations", "rewinds")

# The dataclass stats() returned before every client's stats() returned a Stats: the same names, read the
# same way (attributes). Kept importable for one release.
ProcessorStats = Stats


# produce() refused an output for good: the error this instance must stop with, if any.
OnRefused = Callable[[Out, KafkaException], "ReliableKafkaError | None"]


class Checkpoint:
    """The transaction being filled, the one being committed in the background, and what waits for it.

    A transaction opens with the first processed record (begin), takes outputs and offsets in bulk
    (write), and is handed to the committer thread when `max_batch_messages` records are in or its
    `interval_s` is up (commit). Records processed while a commit runs wait in the backlog, and go into
    the next transaction once the commit is through (reap). A failed step aborts, or recreates the
    producer when the outcome is unknown, and rewinds the consumer (rewind); `positions` then says,
    per partition, the next offset to process, and the loop skips what was fetched before.
    """

    def __init__(self, producer_config: dict[str, Any], *, transactional_id: str, group_id: str,
                 max_batch_messages: int, interval_s: float, deadlines: Deadlines, reset_to: int,
                 stopping: threading.Event, on_refused: OnRefused,
                 on_commit: Callable[[CommitInfo], None] | None = None,
                 client: Callable[[dict[str, Any]], Producer] = Producer) -> None:
        """`client` makes the transactional producer from `producer_config` (a stand-in, in tests)."""
        # The producer's lifecycle; its handle is read once per batch as self.client.producer.
        self.client = TransactionalClient(producer_config, transactional_id=transactional_id,
                                          deadlines=deadlines, make=client)
        self.transactional_id = transactional_id
        self._group_id = group_id
        self.max_batch = max_batch_messages
        self.interval_s = interval_s
        self.deadlines = deadlines
        self._reset_to = reset_to  # where a rewind goes for a partition without a committed offset
        self._stopping = stopping
        self._on_refused = on_refused
        self._on_commit = on_commit
        self.consumer: Consumer | None = None
        self._committer: Committer | None = None
        self._watch = CallWatch()  # the committer thread's current call, to tell slow from hung
        self.counters = Counters(STATS)
        self.broken: ReliableKafkaError | None = None
        self._failed_in_a_row = 0
        # Partitions assigned to us right now, and per partition the next offset to process.
        self.owned: set[TopicPartitionKey] = set()
        self.positions: dict[TopicPartitionKey, int] = {}
        # The open transaction: what has been written into it so far, and when it is due.
        self.open = False
        self.deadline = 0.0
        self._began_at = 0.0  # when begin_transaction() opened it (monotonic)
        self._transaction_timeout_s = int(producer_config.get("transaction.timeout.ms", 60_000)) / 1000
        self._offsets: dict[TopicPartitionKey, int] = {}
        self.messages = 0
        self._outputs = 0
        self._dead = 0
        # The transaction being committed in the background, what it holds, and whether it is over
        # (a plain flag the committer sets: cheaper to read per record than Future.done()).
        self.committing: tuple[Future[Failure | None], CommitInfo] | None = None
        self._commit_over = False
        self._current: Future[Failure | None] | None = None  # the commit _commit_over is about
        # Records processed while a commit was running, to be written into the next transaction.
        self.backlog = Batch()
        self._backlog_since = 0.0
        # When the loop must next look at the clock: a transaction due, or a commit maybe through.
        self.next_check = 0.0

    def start(self) -> None:
        """Initialise the transactional producer (fencing an earlier incarnation) and the committer."""
        self._start_producer(self.client.start())
        self._committer = Committer(f"rk-txn-commit-{self.transactional_id}")

    # ---- the steps ------------------------------------------------------------------------------

    def add(self, batch: Batch) -> Outcome:
        """Write processed records into the open transaction, or queue them while a commit runs; reap a
        finished commit; start a commit when the transaction is due. Sets when to look again."""
        # A commit through, a full backlog, or a hung commit (an idle input never fills the backlog):
        # reap it; the backlog goes in first.
        if (self.committing is not None
                and (self._commit_over or self.backlog.messages >= self.max_batch or self._watch.hung())
                and self.reap(wait=True) is Outcome.REWOUND):
            return Outcome.REWOUND
        now = time.monotonic()
        if self.committing is None:
            if self.write(batch) is Outcome.REWOUND:
                return Outcome.REWOUND
            if self.open and (self.messages >= self.max_batch or now >= self.deadline):
                self.commit()
        elif batch.messages:
            if not self.backlog.messages:
                self._backlog_since = now
            self.backlog.extend(batch)
        if self.committing is not None:
            self.next_check = now + COMMIT_CHECK_S
        else:
            self.next_check = self.deadline if self.open else now + self.interval_s
        return Outcome.DONE

    def begin(self, opened_at: float | None = None) -> Outcome:
        producer = self.client.producer
        assert producer is not None
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            # begin only fails when the producer's state is off: start again from a fresh one.
            fatal = next_step("begin_transaction", exc) is TxnStep.STOP
            self.recover(Failure("begin_transaction", TxnStep.STOP if fatal else TxnStep.RECREATE, exc))
            return Outcome.REWOUND
        self.open = True
        self._began_at = time.monotonic()
        self.deadline = (self._began_at if opened_at is None else opened_at) + self.interval_s
        return Outcome.DONE

    def write(self, batch: Batch, opened_at: float | None = None) -> Outcome:
        """Produce processed records' outputs into the open transaction (opening it) and stage their
        offsets. One loop for many records: the per-record cost is what the benchmark measures."""
        if not batch.messages:
            return Outcome.DONE
        if not self.open and self.begin(opened_at) is Outcome.REWOUND:
            return Outcome.REWOUND
        producer = self.client.producer
        assert producer is not None
        produce = producer.produce
        for topic, value, key, partition, headers, source, offset, dead in each_out(batch.outputs):
            # The header list produce() takes, inline (a call per record costs as much as the rest).
            listed: list[tuple[str, HeaderValue]] = (
                list(headers) if headers.__class__ is tuple else [(ID_HEADER, headers)])  # type: ignore[list-item]
            try:
                try:
                    # Positional, as in ReliableProducer._produce: keywords cost ~1 µs a call.
                    produce(topic, value, key, partition, None, None, 0, listed)
                except BufferError:
                    # Bounded by message.timeout.ms: then queued records fail, which frees room, and
                    # the commit aborts.
                    produce_when_room(producer, topic, value, key, partition, None, None, 0, listed)
            except (KafkaException, TypeError) as exc:
                # The transaction is incomplete: abort it (dead-lettering the input next time round, if
                # Kafka will never take the output), unless the refused output was a dead-letter copy. A
                # TypeError is a value, key or header that is not bytes: Kafka will never take that either.
                refused = exc if isinstance(exc, KafkaException) else not_bytes(topic, value, key, exc)
                stop = self._on_refused((topic, value, key, partition, headers, source, offset, dead), refused)
                self.recover(Failure("produce", next_step("produce", refused), refused))
                if stop is not None:
                    self.broken = stop
                    raise stop from exc
                return Outcome.REWOUND
        self._offsets.update(batch.offsets)
        self.messages += batch.messages
        self._outputs += len(batch.outputs) // OUT_WIDTH
        self._dead += batch.dead
        return Outcome.DONE

    def commit(self) -> None:
        """Hand the open transaction to the committer thread; the loop goes on with the next batch."""
        producer, consumer, committer = self.client.producer, self.consumer, self._committer
        assert producer is not None and consumer is not None and committer is not None
        info = CommitInfo(dict(self._offsets), self.messages, self._outputs, self._dead)
        # Taken now, in the loop's thread: the generation that owns these partitions at this moment.
        metadata = consumer.consumer_group_metadata()
        self.clear()
        self._commit_over = False
        future = committer.submit(self._end_transaction, producer, info.offsets, metadata, self._watch)
        self._current = future
        future.add_done_callback(self._mark_commit_over)
        self.committing = (future, info)

    def _mark_commit_over(self, future: Future[Failure | None]) -> None:
        # A commit given up as hung may still return, much later: it says nothing about the current one.
        if future is self._current:
            self._commit_over = True

    def _end_transaction(
        self, producer: Producer, offsets: dict[TopicPartitionKey, int], metadata: Any, watch: CallWatch
    ) -> Failure | None:
        """Commit a transaction: (1) its outputs, (2) its input offsets, (3) the end marker.

        The order is the point. (1) The outputs were produced first, by write(). (2) send_offsets_to_
        transaction then adds the inputs' next offsets (last processed + 1) to the same transaction,
        tagged with the consumer's group metadata, so a zombie whose generation is stale is refused
        (KIP-447); offsets sent before their outputs could commit input that produced nothing. (3)
        commit_transaction flushes whatever output is still in flight and only then writes the end
        marker. Either all of it becomes visible to read_committed readers, or none of it does and the
        consumer is rewound. Runs in the committer thread; its Failure is handled by reap() in the loop's.
        """
        partitions = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]
        timeout = self.deadlines.timeout
        with telemetry.settle("commit_transaction", self._group_id,
                              **{"reliable_kafka.transactional_id": self.transactional_id}) as settling:
            if partitions:
                sent = call("send_offsets_to_transaction",
                            lambda: producer.send_offsets_to_transaction(partitions, metadata, timeout()),
                            self.deadlines, self.transactional_id, watch)
                if isinstance(sent, Failure):
                    settling.failed(kafka_errors.describe(sent.error))
                    return sent
            done = call("commit_transaction", lambda: producer.commit_transaction(timeout()),
                        self.deadlines, self.transactional_id, watch)
            if isinstance(done, Failure):
                settling.failed(kafka_errors.describe(done.error))
                return done
            return None

    def reap(self, *, wait: bool) -> Outcome:
        """Take the result of the background commit (blocking if `wait`); then write the backlog."""
        if self.committing is None:
            return Outcome.DONE
        future, info = self.committing
        if not wait and not self._commit_over:
            return Outcome.WAITING
        stop_by = self.deadlines.stop_by
        try:
            if wait and stop_by is not None:
                # A commit call cannot be cut short inside librdkafka (a hung coordinator holds it for up
                # to socket.timeout.ms): a stop waits for it only until its own deadline.
                failure = future.result(timeout=max(0.0, stop_by - time.monotonic()))
            else:
                failure = self._result_unless_hung(future)
        except FutureTimeout:
            self.committing = None
            self.abandon("a commit still under way")
            return Outcome.REWOUND
        except _Hung as hung:
            self.committing = None
            self._give_up_hung(hung.operation, hung.reason)
            return Outcome.REWOUND
        self.committing = None
        if failure is not None:
            log.warning("transaction not committed: %s", failure)
            self.recover(failure)
            return Outcome.REWOUND
        self._failed_in_a_row = 0
        counters = self.counters
        counters.add("transactions_committed")
        telemetry.transaction_commits.add(1)
        if info.dead_lettered:
            telemetry.dead_lettered.add(info.dead_lettered)
        counters.add("messages_committed", info.messages)
        counters.add("outputs_committed", info.outputs)
        counters.add("dead_lettered", info.dead_lettered)
        log.debug("committed %d input record(s), %d output(s)", info.messages, info.outputs)
        if self._on_commit is not None:
            self._on_commit(info)
        backlog, self.backlog = self.backlog, Batch()
        # The batch began with the backlog, not now: the interval counts from its first record.
        return self.write(backlog, opened_at=self._backlog_since)

    def _result_unless_hung(self, future: Future[Failure | None]) -> Failure | None:
        """The commit's result, however long it takes, unless one of its librdkafka calls is hung."""
        while True:
            try:
                return future.result(timeout=_HUNG_CHECK_S)
            except FutureTimeout:
                hung = self._watch.hung()
                if hung is not None:
                    raise _Hung(*hung) from None

    def _give_up_hung(self, operation: str, reason: str) -> None:
        """A commit's call will not return: leave it (and its thread) behind and start over from a new
        producer, whose init_transactions fences the old one and aborts the transaction it left open.

        Nothing is lost or doubled: the transaction never committed (its offsets with it), the consumer
        is rewound to the committed offsets, and the old producer can commit nothing once fenced.
        """
        log.error("%s: %s; librdkafka does not return from it (a known librdkafka defect when a coordinator "
                  "goes away): giving up that transaction and recreating the producer", self.transactional_id,
                  reason)
        # The old thread stays inside librdkafka (a daemon: it never holds up the exit); commits go on
        # on a new one, watched afresh.
        self._committer = Committer(f"rk-txn-commit-{self.transactional_id}")
        self._watch = CallWatch()
        self._current = None
        self.recover(Failure(operation, TxnStep.RECREATE, KafkaException(KafkaError(KafkaError._TIMED_OUT, reason))))

    def settle(self, reason: str) -> None:
        """Commit everything processed so far and wait for it (on stop and before partitions go)."""
        while (self.committing is not None or self.open) and self.broken is None:
            if self.committing is None:
                if self.deadlines.overdue():
                    self.abandon(reason)
                    return
                log.debug("committing before returning (%s)", reason)
                self.commit()
            self.reap(wait=True)  # REWOUND: an abort rewound, nothing is left to commit

    def drop(self, reason: str) -> None:
        """Partitions were lost: the open transaction and the backlog go; what is still owned is redone.

        A commit already under way is decided by the coordinator (it refuses a stale generation)."""
        self.backlog.clear()
        if self.reap(wait=True) is Outcome.REWOUND:
            return
        if self.open:
            self.abort(reason)
        else:
            self.rewind()

    def abandon(self, reason: str) -> None:
        """A graceful stop ran out of time: give up the open transaction rather than wait on.

        Nothing is lost: its input offsets were never committed, so the next owner processes its records
        again, and its outputs are aborted (here if the producer still answers, else by the coordinator
        when the next instance with this transactional.id starts, or after transaction.timeout.ms).
        """
        log.warning("%s: the stop ran past stop_timeout_s=%.0fs (%s); giving up the open transaction, whose "
                    "records the next owner processes again", self.transactional_id,
                    self.deadlines.stop_timeout_s, reason)
        self.counters.add("transactions_aborted")
        telemetry.transaction_aborts.add(1)
        had_open = self.open
        self.clear()
        self.backlog.clear()
        producer = self.client.producer
        if had_open and producer is not None:
            with contextlib.suppress(KafkaException):
                producer.abort_transaction(MIN_CALL_S)

    # ---- after a failure ------------------------------------------------------------------------

    def recover(self, failure: Failure) -> None:
        """Act on a failed transactional call as next_step() decided; the consumer ends up rewound.

        A failure that keeps coming back (an output or dead-letter topic that does not exist, say) must
        not spin unseen: each failure in a row waits a little longer, and after _MAX_FAILED_IN_A_ROW the
        instance stops with TransactionFailed. Nothing past the last committed transaction is lost.
        """
        if self._must_stop(failure):
            raise self.stop_with(failure) from failure.error
        if self.deadlines.overdue():
            self.abandon(str(failure))  # no time left to recreate a producer or to retry
            return
        if failure.step is TxnStep.RECREATE:
            self._recreate_producer(str(failure))
        else:
            self.abort(str(failure))
        self._failed_in_a_row += 1
        if self._failed_in_a_row >= _MAX_FAILED_IN_A_ROW:
            self.broken = TransactionFailed(
                f"transactional.id {self.transactional_id!r}: {self._failed_in_a_row} transactions in a row "
                f"failed, the last with {failure}. Nothing past the last committed transaction was lost; check "
                "that the output and dead-letter topics exist and the brokers are healthy, then restart",
                code=kafka_errors.name_of(failure.error),
            )
            raise self.broken from failure.error
        self._stopping.wait(min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (self._failed_in_a_row - 1)))

    def abort(self, reason: str) -> Outcome:
        """Abort the open (or just failed) transaction and rewind the consumer to its committed offsets."""
        producer = self.client.producer
        assert producer is not None
        self.counters.add("transactions_aborted")
        telemetry.transaction_aborts.add(1)
        self.clear()
        failure = call("abort_transaction", lambda: producer.abort_transaction(self.deadlines.timeout()),
                       self.deadlines, self.transactional_id)
        if isinstance(failure, Failure):
            if self._must_stop(failure):
                raise self.stop_with(failure) from failure.error
            if self.deadlines.overdue():
                # No time to start a fresh producer: the coordinator settles the transaction instead.
                log.warning("abort failed while the stop ran out of time (%s); the coordinator aborts it", failure)
                return Outcome.REWOUND
            self._recreate_producer(f"abort failed: {failure}", counted=True)
            return Outcome.REWOUND
        log.warning("transaction aborted (%s); rewinding to the committed offsets", reason)
        return self.rewind()

    def rewind(self) -> Outcome:
        """Forget all uncommitted work and seek every owned partition back to its committed offset."""
        consumer = self.consumer
        self.counters.add("rewinds")
        self.positions.clear()
        self.backlog.clear()
        if consumer is None or not self.owned:
            return Outcome.REWOUND
        if self._stopping.is_set():
            # Stopping: no seek (it could wait on a hung coordinator); instead nothing more is processed
            # here, so no record after the rewound ones can be committed. The next owner starts at the
            # committed offsets.
            self.owned.clear()
            return Outcome.REWOUND
        try:
            self.positions.update(seek_to_committed(consumer, self.owned, deadlines=self.deadlines,
                                                    reset_to=self._reset_to))
        except TransactionFailed as exc:
            self.broken = exc
            raise
        return Outcome.REWOUND

    def _must_stop(self, failure: Failure) -> bool:
        if failure.step is TxnStep.STOP:
            return True
        if not kafka_errors.epoch_bumped(failure.error):
            return False
        # An old epoch while owning no partitions is a zombie's fence: a new producer would fence the
        # instance that owns the work now.
        if not self._owns_partitions():
            return True
        # A partition leader's old-epoch answer to a transaction younger than transaction.timeout.ms: the
        # coordinator cannot have timed it out (it counts from the transaction's first partition, which
        # comes after begin), so a newer instance's init_transactions bumped the epoch. That instance may
        # not have joined the group yet, so owning partitions proves nothing; a new producer here would
        # fence it in turn (the two instances then fence each other until one gives up).
        return (kafka_errors.old_epoch_on_produce(failure.error)
                and time.monotonic() - self._began_at < self._transaction_timeout_s)

    def _owns_partitions(self) -> bool:
        consumer = self.consumer
        if consumer is None:
            return False
        try:
            return bool(consumer.assignment())
        except (KafkaException, RuntimeError):  # RuntimeError: the consumer is already closed
            return False

    def _recreate_producer(self, reason: str, *, counted: bool = False) -> None:
        """Replace the producer: the new one's init_transactions settles whatever the old one left."""
        log.warning("recreating the transactional producer (%s)", reason)
        if not counted:
            self.counters.add("transactions_aborted")
            telemetry.transaction_aborts.add(1)
        self.counters.add("producer_recreations")
        telemetry.rebuilds.add(1)
        self.clear()
        self._start_producer(self.client.replace())
        self.rewind()

    def _start_producer(self, failure: Failure | None) -> None:
        """Act on how the client's init_transactions went: a failure stops the instance."""
        if failure is None:
            return
        if failure.step is TxnStep.STOP:
            raise self.stop_with(failure) from failure.error
        self.broken = self.client.not_initialised(failure)
        raise self.broken from failure.error

    def stop_with(self, failure: Failure) -> ReliableKafkaError:
        """The error this instance stops with (also remembered, so close() does not try to commit)."""
        error = self.client.stop_error(failure)
        self.broken = error
        self.clear()
        self.backlog.clear()
        return error

    # ---- bookkeeping ----------------------------------------------------------------------------

    def clear(self) -> None:
        """Forget the open transaction's contents (it was handed to the committer, aborted or given up)."""
        self.open = False
        self._offsets = {}
        self.messages = self._outputs = self._dead = 0

    def forget(self, gone: set[TopicPartitionKey]) -> None:
        """Partitions went to another member: no position is kept for them."""
        self.owned -= gone
        for key in gone:
            self.positions.pop(key, None)

    def close(self) -> None:
        """Finish a commit under way, abort the open transaction (the next owner redoes its records)."""
        self.backlog.clear()
        try:
            if self.committing is not None and self.broken is None:
                with contextlib.suppress(ReliableKafkaError):
                    self.reap(wait=True)
            producer = self.client.producer
            if self.open and self.broken is None and producer is not None:
                self.open = False
                try:
                    producer.abort_transaction(self.deadlines.timeout())
                except KafkaException as exc:  # the coordinator aborts it after transaction.timeout.ms
                    log.warning("abort on close failed: %s", kafka_errors.describe(exc))
        finally:
            self.clear()

    def shutdown(self) -> None:
        """Release the committer thread and the producer (after the consumer left the group)."""
        if self._committer is not None:
            # A commit given up by an overdue stop may still be inside librdkafka: not waited for.
            self._committer.shutdown(
                timeout=self.deadlines.operation_timeout_s if self.deadlines.stop_by is None else MIN_CALL_S
            )
        self.client.release()
