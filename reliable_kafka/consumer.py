"""ReliableConsumer: commits per partition only what was processed, safe across rebalances.

An offset is committed only when it and every offset before it on that partition were processed
(or parked in the dead-letter topic with an acknowledged write); offsets are committed before a
partition is released, and staged offsets of lost partitions are dropped (failure modes L6, L7).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from reliable_kafka import telemetry
from reliable_kafka.config import consumer_config
from reliable_kafka.dedup.base import DedupStore
from reliable_kafka.dlq import DeadLetterPolicy, dead_letter_headers, dlq_topic_for
from reliable_kafka.errors import (
    CommitFailed,
    ConfigError,
    DeadLetterFailed,
    DedupStoreUnavailable,
    ReliableKafkaError,
    RetriesExhausted,
    RetryInterrupted,
)
from reliable_kafka.ids import message_id_of
from reliable_kafka.kafka_errors import Disposition, classify, describe
from reliable_kafka.offsets import OffsetTracker
from reliable_kafka.retry import RetryPolicy, retry_kafka_call

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("reliable_kafka.rdkafka")

Handler = Callable[[Message], Any]
BatchHandler = Callable[[list[Message]], Any]
KeyFunction = Callable[[Message], "str | None"]

_NO_RETRY = RetryPolicy(attempts=1)
_DEAD_LETTER_TOPIC = DeadLetterPolicy()  # the default: "{topic}.dlq"


@dataclass
class _Work:
    msg: Message
    epoch: int
    key: str | None  # dedup key claimed for this record, if dedup is on


class ReliableConsumer:
    """A consumer group member that never commits past unprocessed work.

    Two ways to use it:
      * handler API: `run(handler)` — retries (RetryPolicy), dead-letter topic, optional bounded
        concurrency (`concurrency=N`, records of one key stay in order), optional batch handler,
        optional dedup store; stops gracefully on `stop()` (e.g. from a SIGTERM handler).
      * explicit API: `for msg in consumer: ...; consumer.ack(msg)` — you say what was processed.
    Offsets are committed every `commit_interval_s` (and every `commit_every` records if set), on
    revoke and on close.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        dead_letter: DeadLetterPolicy | None = _DEAD_LETTER_TOPIC,
        concurrency: int = 1,
        max_in_flight: int = 2_000,
        max_batch: int = 500,
        commit_interval_s: float = 1.0,
        commit_every: int | None = None,
        commit_timeout_s: float = 30.0,
        dedup: DedupStore | None = None,
        dedup_key: KeyFunction | None = None,
        dedup_lease_s: float = 60.0,
        dedup_fail_open: bool = False,
        revoke_timeout_s: float = 30.0,
    ) -> None:
        if not topics:
            raise ConfigError("topics", "subscribe to at least one topic")
        if concurrency < 1:
            raise ConfigError("concurrency", f"must be at least 1, got {concurrency}")
        if max_in_flight < max_batch:
            raise ConfigError("max_in_flight", f"must be at least max_batch ({max_batch})")
        if commit_every is not None and commit_every < 1:
            raise ConfigError("commit_every", f"must be at least 1 (or None: by interval only), got {commit_every}")
        self._config = consumer_config(config)
        self.topics = list(topics)
        self._retry = retry or RetryPolicy()
        self._dead_letter = dead_letter
        self._concurrency = concurrency
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._commit_interval_s = commit_interval_s
        # None: by interval only (as Kafka's auto-commit does, but only processed offsets). A count
        # is compared in the hot path, so None becomes a count that is never reached.
        self._commit_every = sys.maxsize if commit_every is None else commit_every
        self._commit_timeout_s = commit_timeout_s
        self._dedup = dedup
        self._dedup_key: KeyFunction = dedup_key or (lambda m: message_id_of(m.headers()))  # type: ignore[arg-type]
        self._dedup_lease_s = dedup_lease_s
        self._dedup_fail_open = dedup_fail_open
        if dedup is not None and dedup_fail_open:
            log.warning("dedup_fail_open=True: while the dedup store is down, duplicates are processed again")
        self._revoke_timeout_s = revoke_timeout_s

        self._tracker = OffsetTracker()
        # Subscribed to one topic by name (not a ^regex): every record's topic is known without asking.
        self._single_topic = self.topics[0] if len(self.topics) == 1 and not self.topics[0].startswith("^") else None
        self._tracing = telemetry.tracing_enabled()
        self._group = str(self._config["group.id"])
        self._stop = threading.Event()
        self._since_commit = 0
        self._last_commit = time.monotonic()
        self._async_commit_failed = False
        self._confirm_lock = threading.Lock()
        self._to_confirm: list[_Work] = []  # handled records whose dedup key still needs confirming
        self._stuck: list[tuple[_Work, BaseException, int]] = []  # poison whose DLQ write failed
        self._paused_by_us: set[tuple[str, int]] = set()
        self._held: list[_Work] = []  # records waiting for the dedup store (fail-closed)
        self._store_down_since: float | None = None
        self._dlq_producer: Any = None
        self._workers: list[threading.Thread] = []
        self._queues: list[queue.Queue[_Work | None]] = []
        self._handler: Handler | None = None
        self._counts: dict[str, int] = defaultdict(int)

        conf = dict(self._config)
        conf.setdefault("logger", _rdkafka_log)
        conf["error_cb"] = self._on_error
        self._user_on_commit = conf.get("on_commit")
        conf["on_commit"] = self._on_commit
        self._consumer = Consumer(conf)
        self._consumer.subscribe(
            self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )

    # ---- explicit API --------------------------------------------------------------------

    def poll(self, timeout: float = 1.0) -> Message | None:
        """The next record (tracked as in flight until you ack() it), or None."""
        for msg in self._fetch(1, timeout):
            return msg
        return None

    def __iter__(self) -> Iterator[Message]:
        while not self._stop.is_set():
            msg = self.poll(0.5)
            if msg is not None:
                yield msg
            self.maybe_commit()

    def ack(self, msg: Message) -> None:
        """Mark a record processed: its offset may be committed once everything before it is too."""
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        assert topic is not None and partition is not None and offset is not None
        self._tracker.done(topic, partition, offset)
        self._since_commit += 1

    def maybe_commit(self) -> None:
        """Commit if the interval or the count since the last commit is reached.

        In the steady state the commit is asynchronous: a synchronous one stops consumption for a
        round trip to the coordinator and its replicated write (~9 ms each here, 100 of them in 1M
        records: a third of the time). An offset counts as committed only when the broker confirms it
        (_on_commit), and after any failed one the next commit is synchronous again, through the error
        classifier and its retries. Revokes, stop() and close() always commit synchronously.
        """
        if self._since_commit >= self._commit_every or (
            self._since_commit and time.monotonic() - self._last_commit >= self._commit_interval_s
        ):
            if self._async_commit_failed:
                self._async_commit_failed = False
                self.commit()
            else:
                self._commit_async()

    def _commit_async(self) -> None:
        self._flush_confirms()
        offsets = self._tracker.committable()
        self._last_commit = time.monotonic()
        self._since_commit = 0
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                  asynchronous=True)
        except KafkaException as exc:  # refused before it was sent (no coordinator yet, say)
            log.info("asynchronous commit not sent (%s); the next commit is synchronous", describe(exc))
            self._async_commit_failed = True
            return
        self._counts["commits"] += 1

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's report of a commit (served by consume(), on the loop thread)."""
        if self._user_on_commit is not None:
            self._user_on_commit(err, partitions)
        failed = err if err is not None else next((tp.error for tp in partitions if tp.error is not None), None)
        if failed is None:
            self._tracker.mark_committed({(tp.topic, tp.partition): tp.offset for tp in partitions})
            return
        if failed.code() == KafkaError._NO_OFFSET:
            return
        # Nothing is marked committed, so the same offsets are offered again, synchronously.
        self._async_commit_failed = True
        self._counts["commit_failures"] += 1
        log.warning("offset commit failed (%s); committing synchronously next", describe(failed))

    def commit(self, partitions: Sequence[tuple[str, int]] | None = None) -> dict[tuple[str, int], int]:
        """Synchronously commit what is processed (of `partitions`, or all); returns what was committed."""
        self._flush_confirms()
        offsets = self._tracker.committable()
        if partitions is not None:
            wanted = set(partitions)
            offsets = {tp: o for tp, o in offsets.items() if tp in wanted}
        self._last_commit = time.monotonic()
        self._since_commit = 0
        if not offsets:
            return {}
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]

        def attempt() -> list[TopicPartition]:
            result = self._consumer.commit(offsets=tps, asynchronous=False)
            failed = [tp for tp in (result or []) if tp.error is not None]
            if failed:
                raise KafkaException(failed[0].error)
            return tps

        started = time.monotonic()
        try:
            with telemetry.span("commit", **{"messaging.consumer.group.name": self._group}):
                retry_kafka_call(attempt, deadline_s=self._commit_timeout_s, what="offset commit")
        except KafkaException as exc:
            disposition = classify(exc)
            if disposition is Disposition.REBALANCE:
                # The group moved on: these partitions are being revoked and their new owner starts
                # from the last committed offset. Redelivery, never a skip.
                log.info("commit refused by a rebalance (%s); staged offsets are dropped", describe(exc))
                return {}
            if disposition is Disposition.RETRIABLE and "_NO_OFFSET" in describe(exc):
                return {}
            raise CommitFailed(f"could not commit offsets {offsets} within {self._commit_timeout_s:.0f}s: "
                               f"{describe(exc)}") from exc
        telemetry.commit_latency.record(time.monotonic() - started)
        self._tracker.mark_committed(offsets)
        self._counts["commits"] += 1
        return offsets

    # ---- handler API ---------------------------------------------------------------------

    def run(self, handler: Handler | BatchHandler, *, batch: bool = False, stop_after: float | None = None) -> None:
        """Consume until stop() (or `stop_after` seconds), calling `handler` for each record (or batch).

        A handler that raises is retried by the RetryPolicy; a record that still fails goes to the
        dead-letter topic, and its offset is committed only after that write is acknowledged.
        """
        deadline = None if stop_after is None else time.monotonic() + stop_after
        self._handler = self._single(handler) if batch else handler  # type: ignore[assignment]
        batch_handler: BatchHandler | None = handler if batch else None  # type: ignore[assignment]
        self._start_workers()
        try:
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                self._step(batch_handler)
        finally:
            self._drain()

    def stop(self) -> None:
        """Ask run() to finish: stop fetching, finish in-flight records, commit, return. Signal-safe."""
        self._stop.set()

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is processed and leave the group (revoked partitions are committed first)."""
        self._stop.set()
        try:
            self.commit()
        except ReliableKafkaError as exc:
            log.error("final commit failed (records will be redelivered, not lost): %s", exc)
        self._consumer.close()
        if self._dlq_producer is not None:
            self._dlq_producer.close(timeout)

    def __enter__(self) -> ReliableConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def counts(self) -> dict[str, int]:
        """handled, dead_lettered, duplicates_skipped, commits, ..."""
        return dict(self._counts)

    @property
    def assignment(self) -> list[tuple[str, int]]:
        return [(tp.topic, tp.partition) for tp in self._consumer.assignment()]

    # ---- the loop ------------------------------------------------------------------------

    def _step(self, batch_handler: BatchHandler | None) -> None:
        if self._held:
            held = self._take_held()
            if self._dedup is not None:
                self._claim_and_dispatch(held, batch_handler)
            else:
                self._dispatch(held, batch_handler)
        elif self._tracker.in_flight() < self._max_in_flight:
            self._resume_ours()
            if self._dedup is None and batch_handler is None and self._concurrency == 1 and not self._tracing:
                self._run_fast(self._consumer.consume(self._max_batch, 0.1))
            else:
                msgs = self._fetch(self._max_batch, 0.1)
                if msgs:
                    if self._dedup is not None:
                        self._claim_and_dispatch([self._work(m) for m in msgs], batch_handler)
                    else:
                        self._dispatch([self._work(m) for m in msgs], batch_handler)
        else:
            # The backlog is full: pause fetching but keep serving the group, so it does not think we
            # died (max.poll.interval.ms) while handlers catch up. A partition assigned meanwhile is not
            # paused yet and may hand over records: they are tracked and held, never dropped (a dropped
            # record would let a later commit pass it).
            self._hold_paused(0.05)
        if self._stuck:
            self._retry_stuck()
        self._flush_confirms()
        self.maybe_commit()

    def _fetch(self, n: int, timeout: float) -> list[Message]:
        return self._track(self._consumer.consume(n, timeout))

    def _track(self, msgs: list[Message]) -> list[Message]:
        """Track a fetched batch's records as in flight; returns those that are records, not errors."""
        # One pass groups the offsets per partition for one tracker call each (the hot path). A fetch
        # hands over runs of one partition, so the group is looked up once per run, not per record.
        by_tp: dict[tuple[str, int], list[int]] = {}
        offsets: list[int] = []
        run_topic, run_partition = None, None
        errors = False
        for msg in msgs:
            err = msg.error()
            if err is not None:
                errors = True
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    raise KafkaException(err)
                log.warning("consumer error: %s", describe(err))
                continue
            topic, partition = msg.topic(), msg.partition()
            if partition != run_partition or topic != run_topic:
                run_topic, run_partition = topic, partition
                offsets = by_tp.setdefault((topic, partition), [])  # type: ignore[arg-type]
            offsets.append(msg.offset())  # type: ignore[arg-type]
        self._epochs = {tp: self._tracker.track_many(tp[0], tp[1], offs) for tp, offs in by_tp.items()}
        self._fetched = by_tp
        return [m for m in msgs if m.error() is None] if errors else msgs

    def _work(self, msg: Message) -> _Work:
        return _Work(msg, self._epochs[(msg.topic(), msg.partition())], None)  # type: ignore[index]

    def _dispatch(self, works: list[_Work], batch_handler: BatchHandler | None) -> None:
        if batch_handler is not None and self._concurrency == 1 and len(works) > 1:
            self._run_batch(works, batch_handler)
            return
        if self._concurrency == 1:
            for w in works:
                self._process(w)
            return
        for w in works:
            key = w.msg.key()
            route = key if key is not None else f"{w.msg.topic()}/{w.msg.partition()}".encode()
            self._queues[zlib.crc32(route) % self._concurrency].put(w)

    def _run_fast(self, msgs: list[Message]) -> None:
        """The hot path (one thread, a record handler, no dedup, no tracing): handle the batch first,
        then track it as handed out and done in one C-level pass per batch.

        Tracking after handling is safe here: rebalance callbacks run only inside consume(), on this
        thread, so no partition can be revoked between the fetch and the tracking, and nothing is
        committed in between. Anything unusual — an error event in the batch, a handler that raises —
        takes the general path: the whole batch is tracked first, as _fetch() does, and the records
        not yet handled go through _run_each() (retries, DLQ or hold).
        """
        if not msgs:
            return
        if any(map(Message.error, msgs)):
            msgs = self._track(msgs)
            if msgs:
                self._run_each(msgs)
            return
        assert self._handler is not None
        handler = self._handler
        failed_at = None
        try:
            for msg in msgs:
                handler(msg)
        except BaseException as exc:
            failed_at = next(i for i, m in enumerate(msgs) if m is msg)  # the record that raised
            first_error = exc
        if failed_at is None:
            # Per partition, the batch's last offset (dict() keeps the last value per key; offsets
            # increase per partition in delivery order).
            done_through = self._tracker.done_through
            if self._single_topic is not None:
                # One topic: partitions (small ints, cheap to hash) are the keys. A batch is usually
                # cut from one fetch response, so usually all of one partition: then its last record
                # is all there is to know.
                topic = self._single_topic
                first, last = msgs[0], msgs[-1]
                partition, upto = last.partition(), last.offset()
                if first.partition() == partition and upto - first.offset() == len(msgs) - 1:  # type: ignore[operator]
                    # First and last of one partition, offsets without a gap: all of it, in the usual
                    # case, found in O(1) (the exact pass below costs ~35 ns a record, ~3% of the
                    # consumer's time here). Should another partition's records sit inside a gap of
                    # this one's offsets (transaction markers) they are not lost, only not advanced
                    # now: done_through() marks nothing that was not handled, and their partition
                    # advances with the next batch that ends in it or is mixed.
                    done_through(topic, partition, upto)  # type: ignore[arg-type]
                else:
                    parts = list(map(Message.partition, msgs))
                    for part, last_offset in dict(zip(parts, map(Message.offset, msgs), strict=True)).items():
                        done_through(topic, part, last_offset)  # type: ignore[arg-type]
            else:
                offsets = map(Message.offset, msgs)
                keys = zip(map(Message.topic, msgs), map(Message.partition, msgs), strict=True)
                for (t, part), last_offset in dict(zip(keys, offsets, strict=True)).items():
                    done_through(t, part, last_offset)  # type: ignore[arg-type]
            self._counts["handled"] += len(msgs)
            self._since_commit += len(msgs)
            return
        # Handled up to failed_at: track the whole batch, complete what was handled, go on from there.
        self._track(msgs)
        if failed_at:
            self._done_all([self._work(m) for m in msgs[:failed_at]])
            self._counts["handled"] += failed_at
        self._run_each(msgs[failed_at:], first_error)

    def _run_each(self, msgs: list[Message], first_error: BaseException | None = None) -> None:
        """The hot path (one thread, a record handler, no dedup, no tracing): each record's first attempt
        runs bare and the completions reach the tracker in bulk, per partition, reusing the grouping
        _fetch() made; a record that fails goes on through _process() (retries, DLQ or hold), which
        completes it itself."""
        assert self._handler is not None
        handler, epochs, fetched = self._handler, self._epochs, self._fetched
        failed: list[Message] = []
        finished_all = False
        i = 0
        try:
            for i, msg in enumerate(msgs):  # noqa: B007 (i is read in the finally block)
                try:
                    if first_error is not None:  # the first record's first attempt was made by _run_fast()
                        exc, first_error = first_error, None
                        raise exc
                    handler(msg)
                except BaseException as exc:
                    failed.append(msg)
                    self._process(self._work(msg), first_error=exc)
            finished_all = True
        finally:
            if finished_all and not failed:
                finished = fetched
            else:
                # Left early (an exception from _process(), say): record i and the ones after it are
                # not finished. Failed records were completed, or held, by _process() itself.
                upto = len(msgs) if finished_all else i
                skip = {id(m) for m in failed}
                finished = defaultdict(list)
                for m in msgs[:upto]:
                    if id(m) not in skip:
                        finished[(m.topic(), m.partition())].append(m.offset())  # type: ignore[index,arg-type]
            handled = 0
            complete = self._tracker.done_tracked if finished is fetched else self._tracker.done_many
            for (topic, partition), offsets in finished.items():
                complete(topic, partition, offsets, epochs[(topic, partition)])
                handled += len(offsets)
            self._counts["handled"] += handled
            self._since_commit += handled

    def _run_batch(self, works: list[_Work], batch_handler: BatchHandler) -> None:
        msgs = [w.msg for w in works]
        label = f"batch of {len(msgs)}"
        while True:
            try:
                self._retry.run(lambda: batch_handler(msgs), stop_event=self._stop, label=label)
            except RetryInterrupted:
                self._release(works)  # unfinished: delivered again after the restart, without waiting
                return
            except RetriesExhausted as exc:
                if self._store_was_down(exc, label):
                    continue
                # Find the poison one by one: each record gets its own retries, then the DLQ.
                log.warning("batch of %d failed after retries; handling its records one by one", len(msgs))
                for w in works:
                    self._process(w)
                return
            for w in works:
                self._handled(w)
            return

    @staticmethod
    def _single(batch_handler: Any) -> Handler:
        return lambda msg: batch_handler([msg])

    def _process(self, w: _Work, first_error: BaseException | None = None) -> None:
        """Handle one record: retries, then the DLQ. Runs on the loop thread or a worker. `first_error`:
        the first attempt was made already (by _run_each) and raised it."""
        assert self._handler is not None
        handler = self._handler
        label = f"{w.msg.topic()}[{w.msg.partition()}]@{w.msg.offset()}"
        while True:
            replay, first_error = first_error, None  # only the first round starts from a failure
            try:
                if self._tracing:
                    with telemetry.process_span(w.msg, self._group):
                        self._retry.run(lambda: handler(w.msg), stop_event=self._stop, label=label,
                                        first_error=replay)
                else:
                    self._retry.run(lambda: handler(w.msg), stop_event=self._stop, label=label,
                                    first_error=replay)
            except RetryInterrupted:
                self._release([w])  # unfinished, not poison: it is delivered again after the restart
                return
            except RetriesExhausted as exc:
                if self._store_was_down(exc, label):
                    continue
                self._dead_letter_or_hold(w, exc.last_error or exc, exc.attempts)
                return
            self._handled(w)
            return

    def _store_was_down(self, exc: RetriesExhausted, label: str) -> bool:
        """A handler that failed because a dedup store is down (its own inbox, say) has not met a poison
        record: it is retried, holding its partition, until the store is back or the consumer stops."""
        if not isinstance(exc.last_error, DedupStoreUnavailable) or self._stop.is_set():
            return False
        log.error("%s: the handler's dedup store is unavailable (%s); retrying, not dead-lettering", label,
                  exc.last_error)
        self._stop.wait(1.0)
        return True

    def _handled(self, w: _Work) -> None:
        self._counts["handled"] += 1
        if w.key is not None:
            # Confirm before the offset may be committed: effect, then dedup record, then offset.
            with self._confirm_lock:
                self._to_confirm.append(w)
        else:
            self._done(w)

    def _done(self, w: _Work) -> None:
        self._tracker.done(w.msg.topic(), w.msg.partition(), w.msg.offset(), w.epoch)  # type: ignore[arg-type]
        self._since_commit += 1

    def _done_all(self, works: list[_Work]) -> None:
        """_done() for many records: one tracker call per partition (and epoch)."""
        by_tp: dict[tuple[str, int, int], list[int]] = defaultdict(list)
        for w in works:
            by_tp[(w.msg.topic(), w.msg.partition(), w.epoch)].append(w.msg.offset())  # type: ignore[index,arg-type]
        for (topic, partition, epoch), offsets in by_tp.items():
            self._tracker.done_many(topic, partition, offsets, epoch)
        self._since_commit += len(works)

    # ---- dead letters --------------------------------------------------------------------

    def _dead_letter_or_hold(self, w: _Work, error: BaseException, attempts: int) -> None:
        if self._dead_letter is None:
            # No DLQ: the record is never skipped; its partition stops advancing here.
            log.error("record %s[%d]@%d failed for good and there is no DLQ; its partition will not commit "
                      "past it", w.msg.topic(), w.msg.partition(), w.msg.offset())
            self._hold_stuck(w, error, attempts)
            return
        try:
            self._write_dead_letter(w, error, attempts)
        except DeadLetterFailed as exc:
            log.error("%s; partition %s[%d] stops advancing until the DLQ write succeeds",
                      exc, w.msg.topic(), w.msg.partition())
            self._hold_stuck(w, error, attempts)
            return
        self._counts["dead_lettered"] += 1
        telemetry.dead_lettered.add(1)
        self._handled(w)

    def _hold_stuck(self, w: _Work, error: BaseException, attempts: int) -> None:
        with self._confirm_lock:
            self._stuck.append((w, error, attempts))

    def _write_dead_letter(self, w: _Work, error: BaseException, attempts: int) -> None:
        assert self._dead_letter is not None
        from reliable_kafka.producer import ReliableProducer

        topic = w.msg.topic()
        assert topic is not None
        dlq = dlq_topic_for(topic, self._dead_letter.template)
        if self._dlq_producer is None:
            conf = {k: v for k, v in self._config.items()
                    if k.startswith(("bootstrap.", "security.", "sasl.", "ssl.", "client."))}
            conf.update(self._dead_letter.producer_config or {})
            conf.setdefault("topic.metadata.propagation.max.ms", 10_000)
            conf.setdefault("message.timeout.ms", int(self._dead_letter.timeout_s * 1000))
            # Memory mode is enough: the source record stays uncommitted until the DLQ write is acked.
            self._dlq_producer = ReliableProducer(conf, durability="memory", preflight="warn")
        headers = dead_letter_headers(
            topic=topic, partition=w.msg.partition() or 0, offset=w.msg.offset() or 0,
            timestamp_ms=w.msg.timestamp()[1] if w.msg.timestamp()[0] else None,
            error=error, attempts=attempts, original_headers=w.msg.headers(),
        )
        try:
            sent = self._dlq_producer.send(dlq, w.msg.value(), w.msg.key(), headers)
        except ReliableKafkaError as exc:
            raise DeadLetterFailed(f"dead-letter write to {dlq!r} refused: {exc}") from exc
        state = self._dlq_producer.wait(sent, timeout=self._dead_letter.timeout_s)
        if state != "delivered":
            reason = self._dlq_producer.reason(sent) or f"not acknowledged within {self._dead_letter.timeout_s}s"
            if state == "failed":
                self._dlq_producer.forget_failed(sent)
            raise DeadLetterFailed(f"dead-letter write to {dlq!r} failed: {reason}")

    def _retry_stuck(self) -> None:
        with self._confirm_lock:
            stuck, self._stuck = self._stuck, []
        now = time.monotonic()
        still = []
        for w, error, attempts in stuck:
            if self._dead_letter is None or now - getattr(self, "_last_stuck_try", 0.0) < \
                    self._dead_letter.retry_every_s:
                still.append((w, error, attempts))
                continue
            try:
                self._write_dead_letter(w, error, attempts)
            except DeadLetterFailed:
                still.append((w, error, attempts))
                continue
            self._counts["dead_lettered"] += 1
            self._handled(w)
        if stuck and self._dead_letter is not None and \
                now - getattr(self, "_last_stuck_try", 0.0) >= self._dead_letter.retry_every_s:
            self._last_stuck_try = now
        with self._confirm_lock:
            self._stuck.extend(still)

    # ---- dedup ---------------------------------------------------------------------------

    def dedup_key_of(self, msg: Message) -> str | None:
        """The key the dedup store claims for `msg`: its rk-id, unless `dedup_key=` says otherwise.

        A handler whose effect lives in the store (inbox mode) passes it to `store.inbox([key])`, so
        the effect and the confirmation commit together; the consumer's own confirmation after the
        handler then finds the key done and changes nothing.
        """
        return self._dedup_key(msg)

    def _claim_and_dispatch(self, works: list[_Work], batch_handler: BatchHandler | None) -> None:
        """Claim the batch's keys in one store call, skip the confirmed ones, run the claimed ones.

        A busy key (another consumer's live claim, or a dead one's until its lease expires) holds back
        its record and every later record of its partition, so each partition still runs in offset
        order; the loop claims them again on its next step.
        """
        assert self._dedup is not None
        keys = [self._dedup_key(w.msg) for w in works]
        try:
            result = self._dedup.claim([k for k in keys if k is not None], self._dedup_lease_s)
        except DedupStoreUnavailable as exc:
            self._store_outage(exc)
            if self._dedup_fail_open:
                self._dispatch(works, batch_handler)
                return
            # Fail closed: nothing of the batch runs, so nothing past it is confirmed or committed.
            self._held = works
            self._hold_paused(min(2.0, 0.1 * 2 ** min(5, self._counts["store_retries"])))
            return
        self._store_back()
        done, claimed = result.done, result.claimed
        run: list[_Work] = []
        later: list[_Work] = []
        running: set[str] = set()
        blocked: set[tuple[str | None, int | None]] = set()  # partitions behind a busy record
        for w, key in zip(works, keys, strict=True):
            if blocked and (w.msg.topic(), w.msg.partition()) in blocked:
                later.append(w)
            elif key is None:
                run.append(w)
            elif key in done or key in running:
                # Confirmed earlier, or a copy of a key that runs in this batch: its effect covers this one.
                self._counts["duplicates_skipped"] += 1
                telemetry.dedup_hits.add(1)
                self._done(w)
            elif key in claimed:
                w.key = key
                running.add(key)
                run.append(w)
            else:
                blocked.add((w.msg.topic(), w.msg.partition()))
                later.append(w)
        if len(running) < len(claimed):
            # Claimed, but every record of the key waits behind a busy one: free it for the next claim.
            with contextlib.suppress(DedupStoreUnavailable):  # else the lease expires on its own
                self._dedup.release(list(claimed - running))
        if batch_handler is None and self._concurrency == 1 and not self._tracing:
            self._run_claimed(run)
        else:
            self._dispatch(run, batch_handler)
        if later:
            self._held = later
            self._hold_paused(0.2)

    def _run_claimed(self, works: list[_Work]) -> None:
        """_run_each() for records that passed the dedup claim: first attempts bare, then one confirm
        call and one tracker call per partition for the lot (in _flush_confirms)."""
        assert self._handler is not None
        handler = self._handler
        handled: list[_Work] = []
        try:
            for w in works:
                try:
                    handler(w.msg)
                except BaseException as exc:
                    self._process(w, first_error=exc)  # retries, then the DLQ; it confirms on its own
                    continue
                handled.append(w)
        finally:
            self._counts["handled"] += len(handled)
            unkeyed = [w for w in handled if w.key is None]
            if unkeyed:
                self._done_all(unkeyed)
            with self._confirm_lock:
                self._to_confirm.extend(w for w in handled if w.key is not None)

    def _hold_paused(self, timeout: float) -> None:
        """Wait `timeout` seconds with every partition paused, still serving the group (rebalances).

        consume(), not poll(): a record that arrives anyway (from a partition assigned meanwhile) is
        tracked and held with the rest, never handed past the offset tracker.
        """
        self._pause_all()
        fetched = self._fetch(self._max_batch, timeout)  # may run _forget(), which replaces _held
        self._held.extend(self._work(m) for m in fetched)

    def _take_held(self) -> list[_Work]:
        held, self._held = self._held, []
        return held

    def _store_outage(self, exc: Exception) -> None:
        """A store call failed: one log line per outage (not per retry), then count the retry."""
        if not self._counts["store_retries"]:
            self._counts["store_outages"] += 1
            if self._dedup_fail_open:
                log.warning("dedup store unavailable (%s); dedup_fail_open=True: processing without dedup until "
                            "it is back, duplicates are processed again", exc)
            else:
                self._store_down_since = time.monotonic()
                log.error("dedup store unavailable (%s); holding progress, nothing is committed until it is back",
                          exc)
        self._counts["store_retries"] += 1

    def _store_back(self) -> None:
        """A store call succeeded: end the outage, if there was one, and let partitions resume."""
        if self._counts["store_retries"]:
            since, self._store_down_since = self._store_down_since, None
            took = "" if since is None else f" after {time.monotonic() - since:.1f} s"
            log.warning("dedup store is back%s; resuming with dedup", took)
            self._counts["store_retries"] = 0

    def _flush_confirms(self) -> None:
        """Confirm the handled records' keys in one store call; only then may their offsets be committed.

        Effect, then dedup record, then offset: a crash in between redelivers the record, whose key is
        then done (skipped) or its claim expires and it runs again (inbox mode closes that gap).
        """
        with self._confirm_lock:
            pending, self._to_confirm = self._to_confirm, []
        if not pending:
            return
        assert self._dedup is not None
        try:
            self._dedup.confirm([w.key for w in pending if w.key is not None])
        except DedupStoreUnavailable as exc:
            self._store_outage(exc)
            if not self._dedup_fail_open:
                with self._confirm_lock:
                    self._to_confirm = pending + self._to_confirm
                return
            # Fail open: the effect happened; unconfirmed, a redelivery of the record may run again.
        else:
            self._store_back()
        self._done_all(pending)

    def _release(self, works: list[_Work]) -> None:
        """Free the claims of records that did not finish, so their redelivery runs without waiting."""
        keys = [w.key for w in works if w.key is not None]
        if self._dedup is not None and keys:
            with contextlib.suppress(DedupStoreUnavailable):  # the leases expire on their own
                self._dedup.release(keys)

    # ---- workers -------------------------------------------------------------------------

    def _start_workers(self) -> None:
        if self._concurrency == 1 or self._workers:
            return
        for i in range(self._concurrency):
            q: queue.Queue[_Work | None] = queue.Queue()
            t = threading.Thread(target=self._worker, args=(q,), name=f"reliable-kafka-worker-{i}", daemon=True)
            self._queues.append(q)
            self._workers.append(t)
            t.start()

    def _worker(self, q: queue.Queue[_Work | None]) -> None:
        while True:
            w = q.get()
            if w is None:
                return
            try:
                self._process(w)
            except Exception:
                log.exception("worker failed on a record; it stays uncommitted and will be redelivered")

    def _wait_idle(self, timeout: float, partitions: set[tuple[str, int]] | None = None) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._flush_confirms()
            if partitions is None:
                busy = self._tracker.in_flight() - self._stuck_count() > 0 and self._concurrency > 1
            else:
                busy = self._concurrency > 1 and any(
                    self._tracker.in_flight(t, p) for t, p in partitions
                )
            if not busy:
                return True
            time.sleep(0.01)
        return False

    def _stuck_count(self) -> int:
        with self._confirm_lock:
            return len(self._stuck)

    def _drain(self) -> None:
        """Graceful stop: finish in-flight records, confirm, commit."""
        self._wait_idle(self._revoke_timeout_s)
        for q in self._queues:
            q.put(None)
        for t in self._workers:
            t.join(timeout=self._revoke_timeout_s)
        self._workers, self._queues = [], []
        try:
            self.commit()
        except ReliableKafkaError as exc:
            log.error("commit at stop failed (records will be redelivered, not lost): %s", exc)

    # ---- rebalances ----------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self._tracker.reset(tp.topic, tp.partition)
            self._paused_by_us.discard((tp.topic, tp.partition))
        # librdkafka keeps a partition's pause across a rebalance: one we paused (backlog full), lost
        # and were given back would stay paused for ever, its records never fetched. Resuming a
        # partition that is not paused changes nothing.
        self._resume(partitions)
        log.info("assigned %s", [(tp.topic, tp.partition) for tp in partitions])

    def _resume(self, partitions: list[TopicPartition]) -> None:
        if partitions:
            try:
                self._consumer.resume([TopicPartition(tp.topic, tp.partition) for tp in partitions])
            except KafkaException as exc:
                log.debug("resume of %s: %s", [(tp.topic, tp.partition) for tp in partitions], exc)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        # Finish what is in flight for these partitions and commit it before the new owner starts.
        if not self._wait_idle(self._revoke_timeout_s, revoked):
            log.warning("records of revoked partitions still running after %.0fs; they will be redelivered",
                        self._revoke_timeout_s)
        try:
            self.commit(list(revoked))
        except ReliableKafkaError as exc:
            log.error("commit on revoke failed (records will be redelivered, not lost): %s", exc)
        self._forget(revoked)
        log.info("revoked %s", sorted(revoked))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        lost = {(tp.topic, tp.partition) for tp in partitions}
        log.warning("partitions lost %s: staged offsets dropped, records will be redelivered", sorted(lost))
        self._forget(lost)

    def _forget(self, partitions: set[tuple[str, int]]) -> None:
        # Resumed before they go (see _on_assign): paused, they would stay paused if they came back.
        self._resume([TopicPartition(t, p) for t, p in sorted(partitions & self._paused_by_us)])
        self._tracker.drop(partitions)
        with self._confirm_lock:
            self._stuck = [s for s in self._stuck if (s[0].msg.topic(), s[0].msg.partition()) not in partitions]
        self._held = [w for w in self._held if (w.msg.topic(), w.msg.partition()) not in partitions]
        self._paused_by_us -= partitions

    def _pause_all(self) -> None:
        assigned = self._consumer.assignment()
        fresh = [tp for tp in assigned if (tp.topic, tp.partition) not in self._paused_by_us]
        if fresh:
            self._consumer.pause(fresh)
            self._paused_by_us |= {(tp.topic, tp.partition) for tp in fresh}

    def _resume_ours(self) -> None:
        if self._paused_by_us and not self._held and self._store_down_since is None:
            self._consumer.resume([TopicPartition(t, p) for t, p in self._paused_by_us])
            self._paused_by_us.clear()

    def _on_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            log.warning("all brokers are down; nothing is committed until they are back")
        else:
            log.debug("consumer: %s", describe(err))
