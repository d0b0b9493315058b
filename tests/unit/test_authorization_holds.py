"""A message refused for want of an ACL stays pending and goes out once granted: the hold's bookkeeping
(a fake clock) and the producer riding out TOPIC_AUTHORIZATION_FAILED answers on librdkafka's mock
cluster (an error path of the client; the grant on a real secured cluster is in
tests/integration/test_secured_cluster.py)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError

from reliable_kafka.kafka_errors import Disposition, classify, not_authorized
from reliable_kafka.producer import ReliableProducer
from reliable_kafka.producer.holds import FIRST_WAIT_S, MAX_WAIT_S, AuthorizationHolds
from reliable_kafka.testing.mock import MockCluster

# waits: its seconds go to librdkafka's timers against a mock or absent broker, not to code that differs
# between Pythons; `./dev pythons` (the unit tier on 3.10 and 3.13) leaves it out to stay in the budget.
pytestmark = [pytest.mark.timeout(120), pytest.mark.waits]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_authorization_errors_are_their_own_disposition_not_a_permanent_refusal() -> None:
    for code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
                 KafkaError.CLUSTER_AUTHORIZATION_FAILED):
        assert classify(KafkaError(code)) is Disposition.AUTHORIZATION
        assert not_authorized(KafkaError(code))
    # A producer id refused for want of IdempotentWrite is fatal to that client, and still a missing ACL.
    pid_refused = KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED, fatal=True)
    assert classify(pid_refused) is Disposition.FATAL and not_authorized(pid_refused)
    assert classify(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)) is Disposition.PERMANENT


def test_a_held_topic_sends_one_probe_per_wait_and_waits_longer_while_still_denied() -> None:
    clock = Clock()
    holds = AuthorizationHolds(clock)
    assert holds.refused("orders", 7) is True  # starts the hold: said once
    assert holds.refused("orders", 5) is False
    assert holds.takes("orders", 9) and not holds.takes("payments", 8)
    assert holds.due_probes() == []  # the wait is not over
    clock.now += FIRST_WAIT_S
    assert holds.due_probes() == [5]  # the oldest goes first, alone
    assert holds.due_probes() == [] and holds.probing() == {"orders": 5}
    assert not holds.takes("orders", 5)  # the probe itself is handed to librdkafka
    assert holds.held() == 3
    holds.refused("orders", 5)  # still denied: back in the hold, twice the wait
    clock.now += FIRST_WAIT_S
    assert holds.due_probes() == []
    clock.now += FIRST_WAIT_S
    assert holds.due_probes() == [5]
    assert holds.release("orders") == [7, 9]  # the probe went through: the rest, in seq order
    assert not holds and holds.held() == 0


def test_the_wait_between_probes_is_capped() -> None:
    clock = Clock()
    holds = AuthorizationHolds(clock)
    holds.refused("t", 1)
    for _ in range(10):
        clock.now += MAX_WAIT_S
        assert holds.due_probes() == [1]
        holds.refused("t", 1)
    clock.now += MAX_WAIT_S
    assert holds.due_probes() == [1]


@pytest.fixture
def mock() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as m:
        yield m


def _read(mock: MockCluster, topic: str, n: int) -> list[bytes]:
    c = Consumer({"bootstrap.servers": mock.bootstrap_servers, "group.id": uuid.uuid4().hex,
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    got: list[bytes] = []
    try:
        for _ in range(300):
            if len(got) >= n:
                break
            msg = c.poll(0.2)
            if msg is not None and msg.error() is None:
                got.append(msg.value())
    finally:
        c.close()
    return got


def test_messages_refused_for_want_of_an_acl_stay_pending_and_all_go_out_in_order_once_allowed(
    mock: MockCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    mock.create_topic(topic, partitions=1, replication_factor=3)
    caplog.set_level(logging.INFO, logger="reliable_kafka.producer")
    with ReliableProducer({"bootstrap.servers": mock.bootstrap_servers}, outbox_path=tmp_path / "o.db",
                          preflight="off") as p:
        mock.push_request_errors("Produce", [KafkaError.TOPIC_AUTHORIZATION_FAILED] * 3)
        values = [f"v-{i}".encode() for i in range(50)]
        sent = p.send_many([(topic, v) for v in values])
        assert p.flush(60) == 0
        assert all(p.state(s) == "delivered" for s in sent)
        assert p.stats().failed == 0 and p.failed() == []
    assert "not authorized to Write topic" in caplog.text and "kafka-acls" in caplog.text
    assert "writable now" in caplog.text
    assert _read(mock, topic, len(values)) == values
