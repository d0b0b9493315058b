"""Rebalance handler: what the consumer does when partitions are assigned, revoked or lost; owns our pauses.

Guarantee: a revoked partition's processed offsets are committed before it is released, a lost or fenced one's
staged offsets are dropped (redelivered, never skipped), and no partition stays paused across a rebalance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaException, TopicPartition

from reliable_kafka.consumer.commits import CommitCoordinator, Partitions
from reliable_kafka.errors import ReliableKafkaError

log = logging.getLogger(__name__)


class PartitionState(Protocol):
    """A part that keeps records per partition, dropped when the partition is released."""

    def forget(self, partitions: Partitions) -> None: ...


def leave_before_close(client: Consumer, config: Mapping[str, Any], assigned: Callable[[], bool],
                       timeout: float) -> bool:
    """Give the partitions back and leave the group while the application still serves it: the step
    before Consumer.close() of every group consumer here (ReliableConsumer, TransactionalProcessor).

    Unsubscribes, then serves the group with consume() until the client's own revoke callback has run
    (`assigned()` turns False: that callback commits as in any rebalance) and librdkafka has sent its
    LeaveGroup, which clears the member id (the classic protocol; with group.protocol=consumer only the
    revoke is waited for). Records consume() still hands over are dropped: never run, they are never
    committed, and the next owner reads them from the last commit. False if that did not happen within
    `timeout`; the close goes on then.

    Why not leave it to Consumer.close(): a revoke still waiting on the application's queue when the close
    starts (another member joined after the fetch loop stopped) is served from inside it, while librdkafka
    tears the group down. confluent-kafka's wrapper then asks librdkafka for the rebalance protocol and
    unassigns, and either call can wait for good on a group that is gone (librdkafka issues 4041, 4884):
    a SIGTERMed member of the rebalance storm test never exited, in 2 runs of 14, and where it did, the
    revoke's commit failed with _DESTROY.

    A static member (group.instance.id) is left alone: it does not leave the group on close, so its
    partitions wait for it over a restart (KIP-345), and an unsubscribe would send the LeaveGroup.
    """
    if "group.instance.id" in config:
        return True
    member_id_cleared = str(config.get("group.protocol", "classic")).lower() == "classic"
    try:
        client.unsubscribe()
    except (KafkaException, RuntimeError) as exc:  # already closed, or refused: nothing to serve
        log.debug("unsubscribe before close: %s", exc)
        return False
    deadline = time.monotonic() + timeout
    try:
        while assigned() or (member_id_cleared and client.memberid()):
            if time.monotonic() >= deadline:
                log.warning("the group did not take the partitions back within %.0fs; closing anyway (what "
                            "was committed stays, the rest is redelivered)", timeout)
                return False
            client.consume(500, 0.05)
    except Exception as exc:  # noqa: BLE001 - a callback that raises here must not keep the client open
        log.warning("leaving the group before close failed (%s); closing anyway", exc)
        return False
    return True


def _idle(timeout: float, partitions: Partitions | None) -> bool:
    return True  # nothing runs off the loop thread until a strategy with workers says otherwise


class RebalanceHandler:
    """librdkafka's on_assign / on_revoke / on_lost callbacks, and the partitions we paused.

    `wait_idle(timeout, partitions)` is how a revoke waits for records still running on workers: the
    processing strategy sets it when run() starts. `also_forget()` names the parts whose per-partition
    records go with a released partition, besides the commit coordinator's staged offsets.
    """

    def __init__(self, client: Consumer, commits: CommitCoordinator, *, revoke_timeout_s: float,
                 on_assigned: Callable[[Partitions], None] = lambda partitions: None) -> None:
        self.client = client
        self._commits = commits
        self._revoke_timeout_s = revoke_timeout_s
        self._paused_by_us: Partitions = set()
        self._held: Partitions = set()  # as the callbacks said: read without asking librdkafka (see `held`)
        self._states: list[PartitionState] = []
        self.wait_idle: Callable[[float, Partitions | None], bool] = _idle
        self._on_assigned = on_assigned  # the dedup stage: a fenced partition assigned again is open again
        self._fenced: Partitions = set()  # paused because another consumer holds their dedup lease

    def also_forget(self, *states: PartitionState) -> None:
        self._states.extend(states)

    @property
    def held(self) -> list[tuple[str, int]]:
        """The partitions assigned to us, as the callbacks reported them. Unlike Consumer.assignment(), it
        does not wait for the client: a librdkafka call from another thread waits while consume() runs."""
        return sorted(self._held)

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        assigned = {(tp.topic, tp.partition) for tp in partitions}
        self._held |= assigned
        self._fenced -= assigned  # resumed below with the rest
        self._on_assigned(assigned)
        for tp in partitions:
            self._commits.reset(tp.topic, tp.partition)
            self._paused_by_us.discard((tp.topic, tp.partition))
        # librdkafka keeps a partition's pause across a rebalance: one we paused (backlog full), lost
        # and were given back would stay paused for ever, its records never fetched. Resuming a
        # partition that is not paused changes nothing.
        self._resume((tp.topic, tp.partition) for tp in partitions)
        log.info("assigned %s", [(tp.topic, tp.partition) for tp in partitions])

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        revoked = {(tp.topic, tp.partition) for tp in partitions}
        # Finish what is in flight for these partitions and commit it before the new owner starts.
        if not self.wait_idle(self._revoke_timeout_s, revoked):
            # From here no record of these partitions starts (the queued ones are the new owner's to run):
            # what still runs may finish before the commit below and count; the rest is redelivered.
            self._commits.stop_starting(revoked)
            log.warning("records of revoked partitions still running after %.0fs; they will be redelivered",
                        self._revoke_timeout_s)
        try:
            self._commits.commit(list(revoked))
        except ReliableKafkaError as exc:
            log.error("commit on revoke failed (records will be redelivered, not lost): %s", exc)
        self._forget(revoked)
        log.info("revoked %s", sorted(revoked))

    def on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        lost = {(tp.topic, tp.partition) for tp in partitions}
        log.warning("partitions lost %s: staged offsets dropped, records will be redelivered", sorted(lost))
        self._forget(lost)

    def leave(self, config: Mapping[str, Any], timeout: float) -> bool:
        """Give the partitions back before the client closes: see leave_before_close()."""
        return leave_before_close(self.client, config, lambda: bool(self._held), timeout)

    def fenced(self, partitions: Partitions) -> None:
        """Another consumer holds these partitions' dedup lease (we are a zombie for them): drop their
        staged offsets and held records as for a lost partition, and keep them paused until the group
        assigns them again (on_assign resumes them)."""
        fresh = partitions - self._fenced
        self._forget(partitions)
        self._fenced |= partitions
        if fresh:
            try:
                self.client.pause([TopicPartition(t, p) for t, p in sorted(fresh)])
            except KafkaException as exc:  # not assigned any more: nothing to fetch from it anyway
                log.debug("pause of fenced %s: %s", sorted(fresh), exc)

    def _forget(self, partitions: Partitions) -> None:
        # Resumed before they go (see on_assign): paused, they would stay paused if they came back.
        self._resume(sorted(partitions & self._paused_by_us))
        self._commits.forget(partitions)
        for state in self._states:
            state.forget(partitions)
        self._paused_by_us -= partitions
        self._held -= partitions

    def pause_all(self) -> None:
        assigned = self.client.assignment()
        fresh = [tp for tp in assigned if (tp.topic, tp.partition) not in self._paused_by_us]
        if fresh:
            self.client.pause(fresh)
            self._paused_by_us |= {(tp.topic, tp.partition) for tp in fresh}

    def resume_ours(self) -> None:
        """Resume what pause_all() paused (the loop calls it when nothing is held back any more)."""
        if self._paused_by_us:
            self.client.resume([TopicPartition(t, p) for t, p in self._paused_by_us])
            self._paused_by_us.clear()

    def _resume(self, partitions: Iterable[tuple[str, int]]) -> None:
        tps = [TopicPartition(t, p) for t, p in partitions]
        if tps:
            try:
                self.client.resume(tps)
            except KafkaException as exc:
                log.debug("resume of %s: %s", [(tp.topic, tp.partition) for tp in tps], exc)
