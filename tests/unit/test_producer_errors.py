"""ReliableProducer's error paths: bad input refused clearly with nothing lost, and client faults
injected on librdkafka's mock cluster (error paths only: the mock proves no delivery guarantee)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import KafkaError

from reliable_kafka import ConfigError, OutboxCorrupt, OutboxLocked, SerializationError
from reliable_kafka.config import consumer_config, producer_config
from reliable_kafka.producer import Message, ReliableProducer
from reliable_kafka.testing.mock import MockCluster

# waits: its seconds go to librdkafka's timers against a mock or absent broker, not to code that differs
# between Pythons; `./dev pythons` (the unit tier on 3.10 and 3.13) leaves it out to stay in the budget.
pytestmark = [pytest.mark.timeout(120), pytest.mark.waits]

BOOT = {"bootstrap.servers": "127.0.0.1:1"}


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("acks", "1", "leader acknowledge"),
        ("acks", 0, "leader acknowledge"),
        ("request.required.acks", "1", "leader acknowledge"),
        ("enable.idempotence", False, "duplicates"),
        ("max.in.flight.requests.per.connection", 6, "outside 1..5"),
        ("retries", 3, "caps retries"),
        ("transactional.id", "x", "TransactionalProcessor"),
    ],
)
def test_unsafe_producer_settings_are_refused_naming_the_key(key: str, value: object, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as info:
        producer_config({**BOOT, key: value})
    assert info.value.key in (key, "acks", "max.in.flight.requests.per.connection", "retries")


@pytest.mark.parametrize(("key", "value", "why"), [
    ("on_delivery", lambda err, msg: None, "owns delivery reports"),
    ("dr_msg_cb", lambda err, msg: None, "owns delivery reports"),
    ("delivery.report.only.error", True, "never leave the outbox"),
])
def test_settings_that_would_hide_delivery_reports_are_refused(key: str, value: object, why: str) -> None:
    # The producer's own delivery reports clear the outbox; a user's callback would replace them, and
    # reports of failures only would leave every delivered message pending for ever.
    with pytest.raises(ConfigError, match=why) as info:
        ReliableProducer({**BOOT, key: value}, durability="memory", preflight="off")
    assert info.value.key == key


@pytest.mark.parametrize(
    ("key", "value"),
    [("enable.auto.commit", True), ("enable.auto.offset.store", "true"), ("isolation.level", "read_uncommitted"),
     ("auto.offset.reset", "sideways")],
)
def test_unsafe_consumer_settings_are_refused_naming_the_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        consumer_config({**BOOT, "group.id": "g", key: value})
    assert info.value.key == key


def test_safe_defaults_are_what_the_guarantees_need() -> None:
    cfg = producer_config(BOOT)
    assert (cfg["acks"], cfg["enable.idempotence"]) == ("all", True)
    c = consumer_config({**BOOT, "group.id": "g"})
    assert (c["enable.auto.commit"], c["enable.auto.offset.store"], c["isolation.level"]) == (
        False, False, "read_committed")


def test_values_that_are_not_bytes_are_refused_and_nothing_is_spooled(tmp_path: Path) -> None:
    with ReliableProducer(BOOT, outbox_path=tmp_path / "o.db", preflight="off") as p:
        with pytest.raises(SerializationError, match="value_serializer"):
            p.send("t", "a str, not bytes")
        with pytest.raises(SerializationError, match="key"):
            p.send("t", b"v", key=42)
        with pytest.raises(SerializationError):
            p.send_many([("t", b"ok"), ("t", {"not": "bytes"})])
        assert p.pending == 0, "a refused batch spools nothing"
        p.close(0.1)
    with ReliableProducer(BOOT, outbox_path=tmp_path / "s.db", preflight="off",
                          value_serializer=lambda v: repr(v).encode()) as p:
        p.send("t", {"serialized": True})
        assert p.pending == 1
        p.close(0.1)


def test_memory_mode_refuses_an_outbox_path_and_spooled_modes_need_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="outbox_path"):
        ReliableProducer(BOOT, durability="memory", outbox_path=tmp_path / "o.db")
    with pytest.raises(ConfigError, match="outbox_path"):
        ReliableProducer(BOOT, durability="process")


def test_corrupt_outbox_and_second_owner_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"\x00garbage" * 512)
    before = bad.read_bytes()
    with pytest.raises(OutboxCorrupt):
        ReliableProducer(BOOT, outbox_path=bad, preflight="off")
    assert bad.read_bytes() == before, "a corrupt outbox is never rewritten"
    with ReliableProducer(BOOT, outbox_path=tmp_path / "o.db", preflight="off") as first:
        with pytest.raises(OutboxLocked):
            ReliableProducer(BOOT, outbox_path=tmp_path / "o.db", preflight="off")
        first.close(0.1)


@pytest.fixture
def mock() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as m:
        yield m


def _topic(mock: MockCluster) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    mock.create_topic(name, partitions=1, replication_factor=3)
    return name


def test_fatal_idempotence_error_rebuilds_the_producer_and_resends(mock: MockCluster, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    topic = _topic(mock)
    conf = {"bootstrap.servers": mock.bootstrap_servers, "enable.gapless.guarantee": True,
            "message.timeout.ms": 20_000}
    with ReliableProducer(conf, outbox_path=tmp_path / "o.db", preflight="off") as p:
        p.send(topic, b"before")
        assert p.flush(20) == 0
        # With the gapless guarantee librdkafka raises a fatal error on a sequence it cannot repair.
        mock.push_request_errors("Produce", [KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER] * 2)
        caplog.set_level(logging.WARNING, logger="reliable_kafka.producer")
        sent = p.send_many([Message(topic, f"m-{i}".encode()) for i in range(20)])
        assert p.flush(40) == 0
        assert all(p.state(s) == "delivered" for s in sent)
        assert p.stats().recreated >= 1, p.stats()
    assert "recreated it" in caplog.text


def test_retriable_produce_errors_are_ridden_out(mock: MockCluster, tmp_path: Path) -> None:
    topic = _topic(mock)
    with ReliableProducer({"bootstrap.servers": mock.bootstrap_servers}, outbox_path=tmp_path / "o.db",
                          preflight="off") as p:
        mock.push_request_errors("Produce", [KafkaError.NOT_ENOUGH_REPLICAS] * 5)
        sent = p.send(topic, b"eventually")
        assert p.wait(sent, 30) == "delivered"


def test_all_brokers_down_keeps_messages_pending_until_they_are_back(mock: MockCluster, tmp_path: Path) -> None:
    topic = _topic(mock)
    conf = {"bootstrap.servers": mock.bootstrap_servers, "message.timeout.ms": 3000}
    with ReliableProducer(conf, outbox_path=tmp_path / "o.db", preflight="off") as p:
        assert p.wait(p.send(topic, b"first"), 20) == "delivered"
        mock.broker_down(MockCluster.ALL_BROKERS)
        sent = p.send_many([(topic, f"d-{i}".encode()) for i in range(10)])
        time.sleep(5)  # past message.timeout.ms: librdkafka gives up, the outbox does not
        assert p.state(sent[0]) == "pending"
        assert p.stats().retried >= 1
        mock.broker_up(MockCluster.ALL_BROKERS)
        assert p.flush(40) == 0
        assert all(p.state(s) == "delivered" for s in sent)
