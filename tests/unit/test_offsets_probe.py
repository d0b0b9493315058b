"""OffsetsProbe against the librdkafka mock cluster: fresh answers on every call over clients opened once.

The mock does not enforce read_committed, so that stable offsets stop at open transactions is shown on
the real cluster (tests/integration/test_transactions.py aims its kills with this probe).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from reliable_kafka.testing import offsets_probe
from reliable_kafka.testing.mock import MockCluster
from reliable_kafka.testing.offsets_probe import OffsetsProbe

pytestmark = pytest.mark.timeout(90)

TOPIC, GROUP = "probed", "probed-group"


@pytest.fixture
def mock() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as cluster:
        cluster.create_topic(TOPIC, partitions=2)
        yield cluster


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The settings of every client the probe module makes."""
    settings: list[dict[str, Any]] = []

    class Counted(Consumer):
        def __init__(self, config: dict[str, Any]) -> None:
            settings.append(dict(config))
            super().__init__(config)

    monkeypatch.setattr(offsets_probe, "Consumer", Counted)
    return settings


def produce(mock: MockCluster, partition: int, n: int) -> None:
    producer = Producer({"bootstrap.servers": mock.bootstrap_servers})
    for i in range(n):
        producer.produce(TOPIC, f"v{i}".encode(), partition=partition)
    assert producer.flush(30) == 0


def commit(mock: MockCluster, offsets: dict[int, int]) -> None:
    committer = Consumer({"bootstrap.servers": mock.bootstrap_servers, "group.id": GROUP,
                          "enable.auto.commit": False})
    try:
        committer.commit(offsets=[TopicPartition(TOPIC, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        committer.close()


def test_lags_follow_the_group_and_the_topic_over_clients_opened_once(mock: MockCluster,
                                                                       made: list[dict[str, Any]]) -> None:
    produce(mock, 0, 10)
    produce(mock, 1, 4)
    with OffsetsProbe(mock.bootstrap_servers) as probe:
        assert probe.end_offsets(TOPIC) == {0: 10, 1: 4}
        assert probe.group_lags(GROUP, TOPIC) == {0: 10, 1: 4}  # nothing committed: all of it is lag
        commit(mock, {0: 6})
        assert probe.group_lags(GROUP, TOPIC) == {0: 4, 1: 4}
        produce(mock, 1, 3)
        commit(mock, {0: 10, 1: 2})
        assert probe.group_lags(GROUP, TOPIC) == {0: 0, 1: 5}
        assert probe.group_lag(GROUP, TOPIC) == 5
        assert probe.uncommitted_records(TOPIC) == 0  # no transaction open
    # One client for the stable end offsets, one for the group, one for the high watermarks: not one a call.
    assert sorted((s["isolation.level"], s["group.id"] == GROUP) for s in made) == [
        ("read_committed", False), ("read_committed", True), ("read_uncommitted", False)]
    assert all(s["enable.auto.commit"] is False for s in made)


def test_a_coordinator_still_loading_is_asked_again(mock: MockCluster) -> None:
    produce(mock, 0, 3)
    commit(mock, {0: 1})
    mock.push_request_errors("OffsetFetch", [KafkaError.COORDINATOR_LOAD_IN_PROGRESS] * 3)
    with OffsetsProbe(mock.bootstrap_servers) as probe:
        assert probe.committed(GROUP, TOPIC, [0, 1]) == {0: 1, 1: 0}


def test_a_closed_probe_refuses_to_answer(mock: MockCluster) -> None:
    probe = OffsetsProbe(mock.bootstrap_servers)
    probe.end_offsets(TOPIC)
    probe.close()
    with pytest.raises(RuntimeError, match="closed"):
        probe.end_offsets(TOPIC)
