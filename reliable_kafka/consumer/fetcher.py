"""Fetch loop: takes records from the client, tracks them as in flight, applies backpressure, holds records back.

Guarantee: a record is tracked before it can be passed by a commit, and a held record is never dropped:
it runs later, or is forgotten with its partition (revoked or lost) and redelivered to the new owner.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message

from reliable_kafka import telemetry
from reliable_kafka.consumer.work import Work
from reliable_kafka.errors import GroupAuthorizationFailed, TopicAuthorizationFailed
from reliable_kafka.kafka_errors import describe
from reliable_kafka.offsets import OffsetTracker

if TYPE_CHECKING:
    from reliable_kafka.consumer.dedup_stage import DedupStage
    from reliable_kafka.consumer.rebalance import RebalanceHandler

log = logging.getLogger(__name__)

# How often a full backlog is looked at while it is waited out (Fetcher.room_wait_s).
_ROOM_POLL_S = 0.002

class Strategy(Protocol):
    """How records are run (strategies.py); the fetch loop only hands batches over."""

    def handle_fetched(self, msgs: list[Message]) -> None: ...

    def handle(self, works: list[Work]) -> None: ...


class Fetcher:
    """Fetches batches for the loop (`step()`) and for the explicit API (`fetch()`)."""

    # How long a full backlog is waited out before the partitions are paused (see _room_within).
    room_wait_s = 0.5

    def __init__(self, client: Consumer, tracker: OffsetTracker, rebalance: RebalanceHandler,
                 dedup: DedupStage | None, *, max_batch: int, max_in_flight: int, group: str = "") -> None:
        self._client = client
        self._tracker = tracker
        self._rebalance = rebalance
        self._dedup = dedup
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._held: list[Work] = []  # tracked records that may not run yet (backlog full, dedup store down)
        # The last tracked batch, grouped: offsets per partition and each partition's epoch.
        self.fetched: dict[tuple[str, int], list[int]] = {}
        self.epochs: dict[tuple[str, int], int] = {}
        self._missing_warned: set[str | None] = set()  # subscribed topics found missing, said once each
        self._group = group
        self.consumed_attrs = {**telemetry.RECEIVE, "messaging.consumer.group.name": group}
        self._denied_said: set[tuple[int, str | None]] = set()  # (code, topic) of refusals said once each

    def step(self, strategy: Strategy) -> None:
        """One pass: run the held records, or fetch a batch, or wait paused while the backlog is full."""
        if self._held:
            held, self._held = self._held, []
            strategy.handle(held)
        elif self._tracker.in_flight() < self._max_in_flight:
            if self._dedup is None or self._dedup.store_up:
                self._rebalance.resume_ours()
            strategy.handle_fetched(self._client.consume(self._max_batch, 0.1))
        elif not self._room_within(self.room_wait_s):
            # The backlog stayed full: pause fetching but keep serving the group, so it does not think we
            # died (max.poll.interval.ms) while handlers catch up. A partition assigned meanwhile is not
            # paused yet and may hand over records: they are tracked and held, never dropped (a dropped
            # record would let a later commit pass it).
            self.hold_paused(0.05)

    def _room_within(self, timeout: float) -> bool:
        """Wait up to `timeout` for the backlog to drop below max_in_flight, without pausing: a pause makes
        librdkafka drop what it prefetched for the partitions, and the resume fetches it again. Pausing
        at once cost AsyncReliableConsumer, whose handlers run a little behind the fetch all the time,
        about half a second per pause: 3.2 s for 20,000 records against a mock cluster, 0.03 s synchronously.
        While it waits the client is not polled, so the wait stays far below max.poll.interval.ms."""
        deadline = time.monotonic() + timeout
        in_flight, limit = self._tracker.in_flight, self._max_in_flight
        while in_flight() >= limit:
            if time.monotonic() >= deadline:
                return False
            time.sleep(_ROOM_POLL_S)
        return True

    def fetch(self, n: int, timeout: float) -> list[Message]:
        return self.track(self._client.consume(n, timeout))

    def track(self, msgs: list[Message]) -> list[Message]:
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
                if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                    self._missing_topic(msg.topic())
                    continue
                if err.code() in (KafkaError.GROUP_AUTHORIZATION_FAILED, KafkaError.TOPIC_AUTHORIZATION_FAILED):
                    self._denied(err.code(), msg.topic())
                    continue
                log.warning("consumer error: %s", describe(err))
                continue
            topic, partition = msg.topic(), msg.partition()
            if partition != run_partition or topic != run_topic:
                run_topic, run_partition = topic, partition
                offsets = by_tp.setdefault((topic, partition), [])  # type: ignore[arg-type]
            offsets.append(msg.offset())  # type: ignore[arg-type]
        self.epochs = {tp: self._tracker.track_many(tp[0], tp[1], offs) for tp, offs in by_tp.items()}
        self.fetched = by_tp
        if by_tp:  # once per fetched batch
            count = sum(map(len, by_tp.values())) if errors else len(msgs)
            telemetry.consumed_messages.add(count, self.consumed_attrs)
        return [m for m in msgs if m.error() is None] if errors else msgs

    def _missing_topic(self, topic: str | None) -> None:
        # librdkafka reports "Subscribed topic not available" as a consume error once per subscription,
        # easy to miss among other logs while the consumer just reads nothing (it picks the topic up once
        # created): said once per topic as a warning with the fix, repeats (a re-subscribe) at debug.
        if topic in self._missing_warned:
            log.debug("subscribed topic %r still does not exist", topic)
            return
        self._missing_warned.add(topic)
        log.warning("subscribed topic %r does not exist, so nothing is read from it: create it with "
                    "reliable_kafka.ensure_topic(config, %r) or kafka-topics.sh --create --topic %s "
                    "--replication-factor 3 --config min.insync.replicas=2; it is read once it exists",
                    topic, topic, topic)

    def _denied(self, code: int, topic: str | None) -> None:
        # librdkafka keeps asking (joining the group, fetching metadata), so the consumer reads as soon as
        # the ACL is granted: the refusal is said once, as an error with the grant, and not raised.
        if (code, topic) in self._denied_said:
            return
        self._denied_said.add((code, topic))
        denied = (GroupAuthorizationFailed(self._group) if code == KafkaError.GROUP_AUTHORIZATION_FAILED
                  else TopicAuthorizationFailed(topic or "?", "Read"))
        log.error("%s; nothing is read until it is granted", denied)

    def work(self, msg: Message) -> Work:
        """A record of the last tracked batch, as Work."""
        return Work(msg, self.epochs[(msg.topic(), msg.partition())], None)  # type: ignore[index]

    def hold(self, works: list[Work], timeout: float) -> None:
        """Hold `works` back for the next pass, waiting `timeout` seconds paused first."""
        self._held.extend(works)
        self.hold_paused(timeout)

    def hold_paused(self, timeout: float) -> None:
        """Wait `timeout` seconds with every partition paused, still serving the group (rebalances).

        consume(), not poll(): a record that arrives anyway (from a partition assigned meanwhile) is
        tracked and held with the rest, never handed past the offset tracker.
        """
        self._rebalance.pause_all()
        fetched = self.fetch(self._max_batch, timeout)  # may run forget(), which replaces _held
        self._held.extend(self.work(m) for m in fetched)

    def held_count(self, partitions: set[tuple[str, int]] | None = None) -> int:
        """How many tracked records are held back (of `partitions`, or all). They count as in flight, yet
        none runs until a later pass hands it over: a wait for in-flight records must not wait for them."""
        if partitions is None:
            return len(self._held)
        return sum(1 for w in self._held if (w.msg.topic(), w.msg.partition()) in partitions)

    def forget(self, partitions: set[tuple[str, int]]) -> None:
        """Released partitions: their held records go (the new owner gets them from the last commit)."""
        self._held = [w for w in self._held if (w.msg.topic(), w.msg.partition()) not in partitions]
