"""LocalKafkaCluster's waits follow progress: a node visibly at work is waited for, a stalled one is not."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError

from reliable_kafka.errors import ClusterError
from reliable_kafka.testing import LocalKafkaCluster, free_port


def test_a_wait_moves_its_deadline_while_progress_changes_and_gives_up_once_it_stalls() -> None:
    cluster = LocalKafkaCluster(brokers=3)  # not started: _wait needs no running node
    started = time.monotonic()
    ticks = iter(range(1_000_000))

    def progress() -> int:  # at work for 1.2 s, then stalled
        return next(ticks) if time.monotonic() - started < 1.2 else -1

    with pytest.raises(ClusterError, match="without progress"):
        cluster._wait(lambda: False, 0.5, "a test condition", progress=progress, cap=10)
    waited = time.monotonic() - started
    assert 1.6 <= waited < 3.5, waited  # 1.2 s of progress, then the 0.5 s bound from the last change


def test_a_wait_that_keeps_progressing_stops_at_its_cap() -> None:
    cluster = LocalKafkaCluster(brokers=3)
    ticks = iter(range(1_000_000))
    started = time.monotonic()
    with pytest.raises(ClusterError, match="timed out after"):
        cluster._wait(lambda: False, 0.5, "a test condition", progress=lambda: next(ticks), cap=1.5)
    assert 1.4 <= time.monotonic() - started < 3.0


def test_a_wait_returns_as_soon_as_its_condition_holds() -> None:
    cluster = LocalKafkaCluster(brokers=3)
    started = time.monotonic()
    cluster._wait(lambda: time.monotonic() - started > 0.3, 5, "a test condition", progress=lambda: 0, cap=20)
    assert time.monotonic() - started < 2


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    # A port the kernel hands out itself (an outgoing connection, a bind to port 0) could be taken
    # between the check and the broker's bind, or while a killed broker is down.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(p < low for p in ports), ports


class _Metadata:
    """What list_topics() answers: the topic unknown for the first `unknown_for` answers, then known."""

    def __init__(self, unknown_for: int) -> None:
        self.answers = 0
        self.unknown_for = unknown_for

    def list_topics(self, topic: str, timeout: float) -> object:
        self.answers += 1
        if self.answers <= self.unknown_for:
            return SimpleNamespace(topics={topic: SimpleNamespace(error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART),
                                                                  partitions={})})
        p = SimpleNamespace(leader=2, replicas=[1, 2, 3], isrs=[1, 2, 3])
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: p})})


def test_a_partition_a_lagging_broker_does_not_know_yet_is_asked_about_again(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = LocalKafkaCluster(brokers=3)
    metadata = _Metadata(unknown_for=3)  # e.g. answered by a broker that restarted a moment ago
    monkeypatch.setattr(cluster, "admin", lambda: metadata)
    state = cluster.partition_state("t")
    assert state is not None and state.leader == 2 and metadata.answers == 4
    never = _Metadata(unknown_for=10**6)
    monkeypatch.setattr(cluster, "admin", lambda: never)
    started = time.monotonic()
    assert cluster.partition_state("t", timeout=0.5) is None
    assert time.monotonic() - started < 3


def test_jvm_options_given_as_one_string_are_refused_rather_than_split_into_characters() -> None:
    with pytest.raises(TypeError, match="sequence of flags"):
        LocalKafkaCluster(brokers=1, jvm_options="-XX:TieredStopAtLevel=1")  # a str is a Sequence[str] too
    assert LocalKafkaCluster(brokers=1, jvm_options=["-Xss1m"]).jvm_options == ["-Xss1m"]


def test_the_paused_follower_recipe_reads_the_fetch_wait_the_nodes_run_with() -> None:
    # faults.followers_paused waits out a follower's parked fetch for this long (plus a second): it must be
    # the nodes' setting, the harness's own unless broker_config overrides it, not Kafka's 500 ms default.
    assert LocalKafkaCluster(brokers=3).broker_setting("replica.fetch.wait.max.ms") == 2000
    overridden = LocalKafkaCluster(brokers=3, broker_config={"replica.fetch.wait.max.ms": 700})
    assert overridden.broker_setting("replica.fetch.wait.max.ms") == 700
    assert LocalKafkaCluster(brokers=3).broker_setting("log.retention.ms", "Kafka's default") == "Kafka's default"
