"""Commit coordinator: owns the offset tracker and decides when, and what, a consumer commits.

Guarantee: only processed offsets are committed, dedup keys are confirmed before their offsets, and an
offset counts as committed only once the broker confirmed it; after a failed commit the next is synchronous.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from reliable_kafka import telemetry
from reliable_kafka.consumer.work import Work
from reliable_kafka.errors import CommitFailed, ConfigError
from reliable_kafka.kafka_errors import Disposition, classify, describe, name_of
from reliable_kafka.offsets import OffsetTracker
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.stats import Counters

log = logging.getLogger(__name__)

Partitions = set[tuple[str, int]]


@dataclass(frozen=True)
class CommitPolicy:
    """When a consumer commits: every `interval_s` seconds and, if `every` is set, every `every` processed
    records; `timeout_s` bounds one synchronous commit (retried within it) before CommitFailed."""

    interval_s: float = 1.0
    every: int | None = None  # None: by interval only, as Kafka's auto-commit (but only processed offsets)
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ConfigError("CommitPolicy.every",
                              f"must be at least 1 (or None: by interval only), got {self.every}")
        if self.interval_s < 0:
            raise ConfigError("CommitPolicy.interval_s", f"must not be negative, got {self.interval_s}")


class CommitCoordinator:
    """The consumer's offsets: the tracker of what is in flight and done, and the commits made of it.

    The fetch side tracks records in `tracker`; whoever finishes a record calls `done()` (or, on the hot
    path, the tracker directly and then `processed(n)`). `maybe_commit()` runs once per loop pass; the
    rebalance handler commits synchronously with `commit(partitions)` and `forget()`s what is released.
    """

    def __init__(
        self,
        client: Consumer,
        policy: CommitPolicy,
        counters: Counters,
        *,
        group: str,
        confirm: Callable[[], list[Work]] | None = None,
        user_on_commit: Callable[[KafkaError | None, list[TopicPartition]], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tracker = OffsetTracker()
        self._client = client
        self._counters = counters
        self._group = group
        # The dedup stage's confirmation, the step before any commit: effect, then dedup record, then offset.
        self._confirm = confirm
        self._user_on_commit = user_on_commit
        self._clock = clock
        self._interval_s = policy.interval_s
        # A count is compared in the hot path, so None (by interval only) becomes one never reached.
        self._every = sys.maxsize if policy.every is None else policy.every
        self._timeout_s = policy.timeout_s
        self._since_commit = 0
        self._last_commit = clock()
        self._async_commit_failed = False
        # When the asynchronous commit in flight was sent (None: none is). One at a time, because
        # librdkafka retries a commit that timed out or lost its coordinator by itself, after a
        # backoff: a newer commit sent meanwhile can land first, and the retried older one then
        # overwrites it (the group's offsets are last-writer-wins). The broker would hold an offset
        # behind the one we saw confirmed, and nothing would ever commit that partition again.
        self._async_sent_at: float | None = None

    # ---- what is done ---------------------------------------------------------------------

    def committable(self) -> dict[tuple[str, int], int]:
        """Next-offsets that are processed and not committed yet (what the next commit would send)."""
        return self.tracker.committable()

    @property
    def pending(self) -> int:
        """Records processed since the last commit."""
        return self._since_commit

    def processed(self, n: int) -> None:
        """`n` records were marked done in the tracker directly (the hot path does, once per batch)."""
        self._since_commit += n

    def ack(self, topic: str, partition: int, offset: int) -> None:
        """The explicit API's ack(): the offset was handed out by poll() and is processed now."""
        self.tracker.done(topic, partition, offset)
        self._since_commit += 1

    def done(self, w: Work) -> None:
        self.tracker.done(w.msg.topic(), w.msg.partition(), w.msg.offset(), w.epoch)  # type: ignore[arg-type]
        self._since_commit += 1

    def done_all(self, works: list[Work]) -> None:
        """done() for many records: one tracker call per partition (and epoch)."""
        if not works:
            return
        by_tp: dict[tuple[str, int, int], list[int]] = defaultdict(list)
        for w in works:
            by_tp[(w.msg.topic(), w.msg.partition(), w.epoch)].append(w.msg.offset())  # type: ignore[index,arg-type]
        for (topic, partition, epoch), offsets in by_tp.items():
            self.tracker.done_many(topic, partition, offsets, epoch)
        self._since_commit += len(works)

    def confirm_handled(self) -> None:
        """Confirm the dedup keys of handled records; those confirmed become committable."""
        if self._confirm is not None:
            self.done_all(self._confirm())

    def forget(self, partitions: Partitions) -> None:
        """Released partitions: their staged offsets are dropped, late completions become stale."""
        self.tracker.drop(partitions)

    def stop_starting(self, partitions: Partitions) -> None:
        """Partitions about to be released by a revoke that gave up waiting: their records not started yet
        do not start (OffsetTracker.may_start); those running may still finish and be committed."""
        self.tracker.stop_starting(partitions)

    def reset(self, topic: str, partition: int) -> None:
        self.tracker.reset(topic, partition)

    # ---- commits --------------------------------------------------------------------------

    def maybe_commit(self) -> None:
        """Commit if the interval or the count since the last commit is reached.

        In the steady state the commit is asynchronous: a synchronous one stops consumption for a
        round trip to the coordinator and its replicated write (~9 ms each here, 100 of them in 1M
        records: a third of the time). An offset counts as committed only when the broker confirms it
        (on_commit), and after any failed one the next commit is synchronous again, through the error
        classifier and its retries. Revokes, stop() and close() always commit synchronously.
        """
        if self._since_commit >= self._every or (
            self._since_commit and self._clock() - self._last_commit >= self._interval_s
        ):
            if self._async_sent_at is not None:
                # The last one has not reported yet: wait for it (its report is served by consume()),
                # unless it is overdue, then commit synchronously, as after a failure.
                if self._clock() - self._async_sent_at < self._timeout_s:
                    return
                log.warning("asynchronous commit unanswered after %.0fs; committing synchronously",
                            self._timeout_s)
                self._async_sent_at = None
                self._async_commit_failed = True
            if self._async_commit_failed:
                self._async_commit_failed = False
                self.commit()
            else:
                self.commit_async()

    def commit_async(self) -> None:
        self.confirm_handled()
        offsets = self.tracker.committable()
        self._last_commit = self._clock()
        self._since_commit = 0
        if not offsets:
            return
        try:
            self._client.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()],
                                asynchronous=True)
        except KafkaException as exc:  # refused before it was sent (no coordinator yet, say)
            log.info("asynchronous commit not sent (%s); the next commit is synchronous", describe(exc))
            self._async_commit_failed = True
            return
        self._async_sent_at = self._last_commit
        self._counters.add("commits")

    def on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's report of a commit (served by consume(), on the loop thread)."""
        # Only asynchronous commits report here (a synchronous one returns its result instead).
        self._async_sent_at = None
        if self._user_on_commit is not None:
            self._user_on_commit(err, partitions)
        failed = err if err is not None else next((tp.error for tp in partitions if tp.error is not None), None)
        if failed is None:
            landed = {(tp.topic, tp.partition): tp.offset for tp in partitions}
            if self.tracker.mark_landed(landed):
                # A synchronous commit (a revoke's, a user's) confirmed a later offset before this older
                # one landed: the broker may now hold the older one. Offer the newer one again.
                log.info("an older commit landed after a newer one; committing the newer offsets again")
                self._since_commit = max(self._since_commit, 1)
            return
        if failed.code() == KafkaError._NO_OFFSET:
            return
        # Nothing is marked committed, so the same offsets are offered again, synchronously, at the next
        # interval even if nothing new is processed by then (at the end of a stream, say).
        self._async_commit_failed = True
        self._since_commit = max(self._since_commit, 1)
        self._counters.add("commit_failures")
        log.warning("offset commit failed (%s); committing synchronously next", describe(failed))

    def commit(self, partitions: Sequence[tuple[str, int]] | None = None) -> dict[tuple[str, int], int]:
        """Synchronously commit what is processed (of `partitions`, or all); returns what was committed."""
        # 1. Confirm dedup keys first: once its offset is committed a record is never redelivered, and
        #    only its confirmed key still stops another copy of it (a producer's retry) from running.
        self.confirm_handled()
        # 2. Then the offsets, classified by the one Kafka error classifier.
        offsets = self.tracker.committable()
        if partitions is not None:
            wanted = set(partitions)
            offsets = {tp: o for tp, o in offsets.items() if tp in wanted}
        self._last_commit = self._clock()
        self._since_commit = 0
        if not offsets:
            return {}
        tps = [TopicPartition(t, p, o) for (t, p), o in offsets.items()]

        def attempt() -> list[TopicPartition]:
            result = self._client.commit(offsets=tps, asynchronous=False)
            failed = [tp for tp in (result or []) if tp.error is not None]
            if failed:
                raise KafkaException(failed[0].error)
            return tps

        try:
            # Its span, and messaging.client.operation.duration{messaging.operation.name="commit"}.
            with telemetry.settle("commit", self._group):
                retry_kafka_call(attempt, deadline_s=self._timeout_s, what="offset commit")
        except KafkaException as exc:
            disposition = classify(exc)
            if disposition is Disposition.REBALANCE:
                # The group moved on: these partitions are being revoked and their new owner starts
                # from the last committed offset. Redelivery, never a skip.
                log.info("commit refused by a rebalance (%s); staged offsets are dropped", describe(exc))
                return {}
            if disposition is Disposition.RETRIABLE and "_NO_OFFSET" in describe(exc):
                return {}
            raise CommitFailed(f"could not commit offsets {offsets} within {self._timeout_s:.0f}s: "
                               f"{describe(exc)}", code=name_of(exc)) from exc
        self.tracker.mark_committed(offsets)
        self._counters.add("commits")
        return offsets
