"""Failure stages for records whose handler raised: retry (RetryPolicy), then the dead-letter topic, else hold.

Guarantee: a record completes only when its handler succeeded or its dead-letter copy was acknowledged;
otherwise it stays in flight, its partition commits nothing past it, and the DLQ write is tried again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from reliable_kafka import telemetry
from reliable_kafka.config import connection_settings
from reliable_kafka.consumer.commits import CommitCoordinator, Partitions
from reliable_kafka.consumer.dedup_stage import DedupStage
from reliable_kafka.consumer.work import AsyncHandler, BatchHandler, Handler, Work
from reliable_kafka.dlq import DeadLetterPolicy, dead_letter_headers, dlq_topic_for
from reliable_kafka.errors import (
    DeadLetterFailed,
    DedupStoreUnavailable,
    PartitionFenced,
    ReliableKafkaError,
    RetriesExhausted,
    RetryInterrupted,
)
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.stats import Counters

log = logging.getLogger(__name__)

Stuck = tuple[Work, BaseException, int]  # a poison record whose DLQ write failed: error, attempts
# Runs a blocking call off the event loop and awaits it (loop.run_in_executor on the consumer's pool).
Offload = Callable[..., Awaitable[bool]]


class DeadLetters:
    """Parks poison records on their dead-letter topic; keeps the ones whose write failed and retries them."""

    def __init__(self, policy: DeadLetterPolicy | None, consumer_config: Mapping[str, Any]) -> None:
        self._policy = policy
        self._consumer_config = consumer_config
        self._producer: Any = None
        self._lock = threading.Lock()  # workers add stuck records while the loop retries them
        self._stuck: list[Stuck] = []
        self._last_try = 0.0

    def write(self, w: Work, error: BaseException, attempts: int) -> None:
        """Write the record's dead-letter copy and wait for its acknowledgement; DeadLetterFailed if not."""
        assert self._policy is not None
        from reliable_kafka.producer import ReliableProducer

        topic = w.msg.topic()
        assert topic is not None
        dlq = dlq_topic_for(topic, self._policy.template)
        if self._producer is None:
            conf = connection_settings(self._consumer_config)
            conf.update(self._policy.producer_config or {})
            conf.setdefault("topic.metadata.propagation.max.ms", 10_000)
            conf.setdefault("message.timeout.ms", int(self._policy.timeout_s * 1000))
            # Memory mode is enough: the source record stays uncommitted until the DLQ write is acked.
            self._producer = ReliableProducer(conf, durability="memory", preflight="warn")
        headers = dead_letter_headers(
            topic=topic, partition=w.msg.partition() or 0, offset=w.msg.offset() or 0,
            timestamp_ms=w.msg.timestamp()[1] if w.msg.timestamp()[0] else None,
            error=error, attempts=attempts, original_headers=w.msg.headers(),
        )
        try:
            sent = self._producer.send(dlq, w.msg.value(), w.msg.key(), headers)
        except ReliableKafkaError as exc:
            raise DeadLetterFailed(f"dead-letter write to {dlq!r} refused: {exc}", topic=dlq, code=exc.code) from exc
        state = self._producer.wait(sent, timeout=self._policy.timeout_s)
        if state != "delivered":
            reason = self._producer.reason(sent) or f"not acknowledged within {self._policy.timeout_s}s"
            if state == "failed":
                self._producer.forget_failed(sent)
            raise DeadLetterFailed(f"dead-letter write to {dlq!r} failed: {reason}", topic=dlq)

    @property
    def enabled(self) -> bool:
        return self._policy is not None

    def hold(self, w: Work, error: BaseException, attempts: int) -> None:
        with self._lock:
            self._stuck.append((w, error, attempts))

    def take_due(self) -> list[Stuck]:
        """The stuck records whose DLQ write is due again (every `retry_every_s`); the rest stay held."""
        if not self._stuck:
            return []
        with self._lock:
            stuck, self._stuck = self._stuck, []
        now = time.monotonic()
        if self._policy is None or now - self._last_try < self._policy.retry_every_s:
            self.put_back(stuck)
            return []
        self._last_try = now
        return stuck

    def put_back(self, stuck: list[Stuck]) -> None:
        with self._lock:
            self._stuck.extend(stuck)

    def stuck_count(self) -> int:
        with self._lock:
            return len(self._stuck)

    def forget(self, partitions: Partitions) -> None:
        with self._lock:
            self._stuck = [s for s in self._stuck if (s[0].msg.topic(), s[0].msg.partition()) not in partitions]

    def close(self, timeout: float) -> None:
        if self._producer is not None:
            self._producer.close(timeout)


class FailureStages:
    """Runs a record (or a batch) through retry → dead letter → hold, and completes what succeeded.

    Any thread may call `process()`; the loop calls `retry_stuck()` once per pass.
    """

    def __init__(self, retry: RetryPolicy, dead_letters: DeadLetters, commits: CommitCoordinator,
                 dedup: DedupStage | None, counters: Counters, stop: threading.Event, *,
                 tracing: bool, group: str) -> None:
        self._retry = retry
        self.dead_letters = dead_letters
        self._commits = commits
        self._dedup = dedup
        self._counters = counters
        self._stop = stop
        self._tracing = tracing
        self._group = group

    def process(self, handler: Handler, w: Work, first_error: BaseException | None = None) -> None:
        """Handle one record: retries, then the DLQ. `first_error`: the first attempt was made already
        (on a fast path) and raised it."""
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
            except (RetryInterrupted, RetriesExhausted) as exc:
                if self.settle(w, exc, label):
                    continue
                return
            self.handled(w)
            return

    async def process_async(self, handler: AsyncHandler, w: Work, *, stop: asyncio.Event,
                            offload: Offload) -> None:
        """process() for an async handler, on the event loop: the same retries (asyncio backoffs, cut
        short by `stop`), then the same settling, which `offload` runs off the loop (a dead-letter
        write waits for its acknowledgement, a dedup release calls the store)."""
        label = f"{w.msg.topic()}[{w.msg.partition()}]@{w.msg.offset()}"
        while True:
            try:
                if self._tracing:
                    with telemetry.process_span(w.msg, self._group):
                        await self._retry.run_async(lambda: handler(w.msg), stop_event=stop, label=label)
                else:
                    await self._retry.run_async(lambda: handler(w.msg), stop_event=stop, label=label)
            except (RetryInterrupted, RetriesExhausted) as exc:
                if await offload(self.settle, w, exc, label):
                    continue
                return
            self.handled(w)
            return

    def settle(self, w: Work, failure: RetryInterrupted | RetriesExhausted, label: str) -> bool:
        """A record whose retries ended without success: unfinished (stop requested) is released, poison
        goes to the DLQ (or is held). Returns True when it is to be run again instead: the handler's own
        dedup store was down, which is no poison. May block (a DLQ write, a wait)."""
        if isinstance(failure, RetryInterrupted):
            self._release([w])  # unfinished, not poison: it is delivered again after the restart
            return False
        if isinstance(failure.last_error, PartitionFenced) and self._dedup is not None:
            # Not poison either: the partition is someone else's now (left in flight, it goes with it),
            # or, if the refusal named only other partitions, the record runs again.
            return self._dedup.fenced_out(w, failure.last_error)
        if self._store_was_down(failure, label):
            return True
        self._dead_letter_or_hold(w, failure.last_error or failure, failure.attempts)
        return False

    def process_batch(self, batch_handler: BatchHandler, handler: Handler, works: list[Work]) -> None:
        """Retry the batch as a whole; if it still fails, find the poison: each record on its own
        (`handler`), with its own retries, then the DLQ."""
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
                log.warning("batch of %d failed after retries; handling its records one by one", len(msgs))
                for w in works:
                    self.process(handler, w)
                return
            for w in works:
                self.handled(w)
            return

    def handled(self, w: Work) -> None:
        self._counters.add("handled")
        if w.key is not None:
            # Confirm before the offset may be committed: effect, then dedup record, then offset.
            assert self._dedup is not None
            self._dedup.confirm_later([w])
        else:
            self._commits.done(w)

    def retry_stuck(self) -> None:
        """Try the due DLQ writes of poison records again; those that fail stay held."""
        still = []
        for w, error, attempts in self.dead_letters.take_due():
            try:
                self.dead_letters.write(w, error, attempts)
            except DeadLetterFailed:
                still.append((w, error, attempts))
                continue
            self._counters.add("dead_lettered")
            self.handled(w)
        if still:
            self.dead_letters.put_back(still)

    def _store_was_down(self, exc: RetriesExhausted, label: str) -> bool:
        """A handler that failed because a dedup store is down (its own inbox, say) has not met a poison
        record: it is retried, holding its partition, until the store is back or the consumer stops."""
        if not isinstance(exc.last_error, DedupStoreUnavailable) or self._stop.is_set():
            return False
        log.error("%s: the handler's dedup store is unavailable (%s); retrying, not dead-lettering", label,
                  exc.last_error)
        self._stop.wait(1.0)
        return True

    def _dead_letter_or_hold(self, w: Work, error: BaseException, attempts: int) -> None:
        if not self.dead_letters.enabled:
            # No DLQ: the record is never skipped; its partition stops advancing here.
            log.error("record %s[%d]@%d failed for good and there is no DLQ; its partition will not commit "
                      "past it", w.msg.topic(), w.msg.partition(), w.msg.offset())
            self.dead_letters.hold(w, error, attempts)
            return
        try:
            self.dead_letters.write(w, error, attempts)
        except DeadLetterFailed as exc:
            log.error("%s; partition %s[%d] stops advancing until the DLQ write succeeds",
                      exc, w.msg.topic(), w.msg.partition())
            self.dead_letters.hold(w, error, attempts)
            return
        self._counters.add("dead_lettered")
        telemetry.dead_lettered.add(1)
        self.handled(w)

    def left_for_new_owner(self, works: list[Work]) -> None:
        """Records that had not started when their partition was released (a revoke that timed out, a lost
        partition): not run here, since the new owner gets them from the last commit and running them too
        would repeat their effects. Their dedup claims are freed so the new owner's run does not wait. May
        call the dedup store."""
        self._counters.add("left_for_new_owner", len(works))
        self._release(works)

    def _release(self, works: list[Work]) -> None:
        if self._dedup is not None:
            self._dedup.release(works)
