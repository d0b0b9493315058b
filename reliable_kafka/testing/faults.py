"""Fault recipes on a LocalKafkaCluster that the tests and the loss lab share.

Each recipe is bounded in time, signals only the cluster's own nodes, and leaves the cluster
healthy when it returns (also when the code inside it raised).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from reliable_kafka.testing.cluster import LocalKafkaCluster, PartitionState

log = logging.getLogger(__name__)

_KAFKA_REPLICA_FETCH_WAIT_MS = 500  # the broker's default replica.fetch.wait.max.ms


@dataclass
class IsolatedLeader:
    leader: int
    followers: list[int]
    new_leader: int | None = None


def settled_state(cluster: LocalKafkaCluster, topic: str, partition: int = 0, timeout: float = 60.0) -> PartitionState:
    """The partition's state once two reads a second apart agree on a leader and a full ISR.

    A broker that restarted a moment ago can still answer metadata requests with what it knew before
    (no leader, or the old one); isolating the node such a read names would isolate the wrong one,
    and the recipe would then lose nothing.
    """
    deadline = time.monotonic() + timeout
    previous: PartitionState | None = None
    while True:
        state = cluster.partition_state(topic, partition)
        settled = state is not None and state.leader >= 0 and sorted(state.isr) == sorted(state.replicas)
        if settled and state == previous:
            assert state is not None
            return state
        previous = state if settled else None
        if time.monotonic() > deadline:
            raise RuntimeError(f"{topic}[{partition}] has no settled leader with a full ISR after {timeout:.0f}s "
                               f"(last seen: {state})")
        time.sleep(1.0)


@contextlib.contextmanager
def isolated_leader(cluster: LocalKafkaCluster, topic: str, partition: int = 0) -> Iterator[IsolatedLeader]:
    """The deterministic acks=1 loss recipe (seed 000): a leader that acknowledges alone, then dies.

    On entry both followers of the partition are paused (SIGSTOP), so only the leader gets what is
    produced inside the block. With two of three controllers paused, the controller quorum cannot
    shrink the ISR either, so the followers stay eligible. On exit the leader is SIGKILLed, the
    followers resume and one of them (which never got the records) is elected; the old leader
    restarts and truncates to the new leader's log. Records that only the old leader had are gone:
    exactly what acks=1 acknowledged and acks=all never did.
    """
    state = settled_state(cluster, topic, partition)
    followers = [r for r in state.replicas if r != state.leader]
    iso = IsolatedLeader(leader=state.leader, followers=followers)
    for f in followers:
        cluster.pause(f)
    # A follower's last fetch, sent before it was paused, stays parked at the leader for up to
    # replica.fetch.wait.max.ms. Records produced meanwhile complete it: the response lands in the
    # paused follower's socket, it appends them when resumed, becomes leader with them, and nothing
    # is lost. Measured: produced at once, 2 of 6 attempts lost nothing; after this wait 9 of 9 lost.
    fetch_wait_s = int(cluster.broker_config.get("replica.fetch.wait.max.ms", _KAFKA_REPLICA_FETCH_WAIT_MS)) / 1000
    time.sleep(3 * fetch_wait_s)
    try:
        yield iso
    finally:
        cluster.kill(iso.leader)
        for f in followers:
            cluster.resume(f)
        iso.new_leader = cluster.wait_for_leader(topic, partition, not_on=iso.leader, timeout=60)
        log.info("%s[%d]: leader %d killed, %d elected", topic, partition, iso.leader, iso.new_leader)
        cluster.start_node(iso.leader)
        cluster.wait_healthy()


def hard_bounce_leader(cluster: LocalKafkaCluster, topic: str, partition: int = 0) -> tuple[int, int]:
    """SIGKILL the partition's leader, wait for a new one, restart the old; returns (old, new)."""
    old = cluster.leader_of(topic, partition)
    if old is None:
        raise RuntimeError(f"{topic}[{partition}] has no leader")
    cluster.kill(old)
    new = cluster.wait_for_leader(topic, partition, not_on=old, timeout=60)
    cluster.start_node(old)
    return old, new
