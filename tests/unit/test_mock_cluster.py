"""MockCluster: the faults injected into the librdkafka mock cluster reach a real confluent-kafka client.

These tests prove error paths only (the mock is not Kafka): each one shows the client meeting the fault,
and where the client should recover, that it did.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from reliable_kafka.errors import ClusterError
from reliable_kafka.testing.mock import MockCluster

# waits: its seconds go to librdkafka's timers against a mock or absent broker, not to code that differs
# between Pythons; `./dev pythons` (the unit tier on 3.10 and 3.13) leaves it out to stay in the budget.
pytestmark = [pytest.mark.timeout(60), pytest.mark.waits]

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as mock:
        yield mock


def offset_of(msg: Message) -> int:
    offset = msg.offset()
    assert offset is not None, "delivered message has no offset"
    return offset


def new_topic(cluster: MockCluster, partitions: int = 1) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.create_topic(name, partitions=partitions, replication_factor=3)
    return name


class StatsProducer:
    """An idempotent acks=all producer with short timeouts that keeps its latest librdkafka statistics."""

    def __init__(self, cluster: MockCluster, **overrides: Any) -> None:
        # The callback closes over a plain list, not self: no reference cycle, so the librdkafka handle
        # is destroyed when the test drops the producer, before the cluster fixture stops the brokers.
        latest: list[dict[str, Any]] = []
        self._latest = latest
        config: dict[str, Any] = {
            "bootstrap.servers": cluster.bootstrap_servers,
            "acks": "all",
            "enable.idempotence": True,
            "linger.ms": 0,
            "message.timeout.ms": 5_000,
            "retry.backoff.ms": 50,
            "retry.backoff.max.ms": 200,
            "reconnect.backoff.ms": 50,
            "reconnect.backoff.max.ms": 200,
            "statistics.interval.ms": 100,
            "stats_cb": lambda raw: latest.append(json.loads(raw)),
        }
        config.update(overrides)
        self.producer = Producer(config)

    def send(self, topic: str, value: bytes, timeout: float = 10.0) -> tuple[KafkaError | None, Message]:
        """Produce one message and wait for its delivery report; returns (error, message)."""
        reports: list[tuple[KafkaError | None, Message]] = []
        self.producer.produce(topic, value, on_delivery=lambda err, msg: reports.append((err, msg)))
        deadline = time.monotonic() + timeout
        while not reports and time.monotonic() < deadline:
            self.producer.poll(0.05)
        assert reports, f"no delivery report within {timeout}s"
        return reports[0]

    def produce_requests(self, node_id: int | None = None) -> int:
        """Produce requests sent so far (to one broker, or to all), per the freshest statistics."""
        # Statistics are emitted every 100 ms: wait for one taken after the calls above.
        self._latest.clear()
        deadline = time.monotonic() + 3
        while not self._latest and time.monotonic() < deadline:
            self.producer.poll(0.05)
        assert self._latest, "no statistics from librdkafka"
        return sum(
            broker["req"].get("Produce", 0)
            for broker in self._latest[-1]["brokers"].values()
            if node_id is None or broker["nodeid"] == node_id
        )

    def leader_of(self, topic: str, partition: int = 0) -> int:
        return int(self.producer.list_topics(topic, timeout=5).topics[topic].partitions[partition].leader)


@pytest.mark.parametrize("code", [KafkaError.INVALID_RECORD, KafkaError.MSG_SIZE_TOO_LARGE])
def test_injected_permanent_produce_error_reaches_the_delivery_report(
    cluster: MockCluster, code: int
) -> None:
    topic = new_topic(cluster)
    client = StatsProducer(cluster)
    cluster.push_request_errors("Produce", [code])

    err, _ = client.send(topic, b"refused")
    assert err is not None and err.code() == code

    # Only one error was pushed: the next message goes through.
    err, msg = client.send(topic, b"accepted")
    assert err is None, err
    assert offset_of(msg) >= 0


def test_idempotent_producer_rides_through_retriable_errors(cluster: MockCluster) -> None:
    topic = new_topic(cluster)

    # Control: without retries the injected error is what the application sees.
    control = StatsProducer(cluster, **{"enable.idempotence": False, "retries": 0})
    cluster.push_request_errors("Produce", [KafkaError.NOT_ENOUGH_REPLICAS])
    err, _ = control.send(topic, b"control")
    assert err is not None and err.code() == KafkaError.NOT_ENOUGH_REPLICAS

    injected = 3
    cluster.push_request_errors(0, [KafkaError.NOT_ENOUGH_REPLICAS] * injected)  # 0 = Produce
    client = StatsProducer(cluster)
    err, msg = client.send(topic, b"survivor")
    assert err is None, err
    assert offset_of(msg) >= 0
    # One refused request per injected error, then the one that succeeded.
    assert client.produce_requests() == injected + 1


def test_leader_move_is_followed_by_the_producer(cluster: MockCluster) -> None:
    topic = new_topic(cluster)
    client = StatsProducer(cluster)
    err, _ = client.send(topic, b"before")
    assert err is None, err

    old_leader = client.leader_of(topic)
    new_leader = next(b for b in cluster.broker_ids if b != old_leader)
    assert client.produce_requests(new_leader) == 0
    cluster.set_leader(topic, 0, new_leader)
    assert client.leader_of(topic) == new_leader

    err, _ = client.send(topic, b"after")
    assert err is None, err
    assert client.produce_requests(new_leader) >= 1


CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from confluent_kafka import Producer
    bootstrap, topic = sys.argv[1], sys.argv[2]
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    announced = False
    def report(err, msg):
        global announced
        if err is None and not announced:
            announced = True
            print("delivered", flush=True)
    deadline = time.monotonic() + 20  # bounded: the test kills it long before
    while time.monotonic() < deadline:
        p.produce(topic, b"x" * 100, on_delivery=report)
        p.poll(0.001)
    """
)


def wait_for_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if readable else b""


def test_cluster_survives_a_sigkilled_client(cluster: MockCluster) -> None:
    topic = new_topic(cluster)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, cluster.bootstrap_servers, topic],
        stdout=subprocess.PIPE,
    )
    try:
        assert wait_for_line(client, timeout=15).strip() == b"delivered"
    finally:
        client.kill()  # SIGKILL, mid-stream, with requests in flight
        client.wait(timeout=10)
        assert client.stdout is not None
        client.stdout.close()
    assert client.returncode == -signal.SIGKILL

    cluster.create_topic(f"{topic}-after")  # the cluster still answers commands
    err, msg = StatsProducer(cluster).send(topic, b"after the kill")
    assert err is None, err
    assert offset_of(msg) > 0  # the killed client's messages are there before it


def test_all_brokers_down_times_out_and_broker_up_recovers(cluster: MockCluster) -> None:
    topic = new_topic(cluster)
    client = StatsProducer(cluster, **{"message.timeout.ms": 1_000})
    # The first send also waits for connections and a producer id; on a loaded host that alone can take
    # longer than the 1 s timeout the fault needs, so it gets a bounded number of attempts too.
    for _ in range(8):
        err, _ = client.send(topic, b"before")
        if err is None:
            break
    assert err is None, err

    for broker_id in cluster.broker_ids:
        cluster.broker_down(broker_id)
    err, _ = client.send(topic, b"during")
    assert err is not None and err.code() == KafkaError._MSG_TIMED_OUT

    cluster.broker_up(MockCluster.ALL_BROKERS)
    # The same client reconnects and restores its producer state, which takes about a second: allow a
    # bounded number of short attempts rather than one long timeout.
    errors = []
    for _ in range(8):
        err, _ = client.send(topic, b"after")
        if err is None:
            break
        errors.append(err.code())
    assert err is None, f"still failing after broker_up: {errors}"


def test_set_rtt_slows_responses(cluster: MockCluster) -> None:
    topic = new_topic(cluster)
    client = StatsProducer(cluster)
    assert client.send(topic, b"warm-up")[0] is None  # connections and producer id are in place

    rtt_ms = 500
    cluster.set_rtt(MockCluster.ALL_BROKERS, rtt_ms)
    started = time.monotonic()
    err, _ = client.send(topic, b"slow")
    assert err is None, err
    assert time.monotonic() - started >= rtt_ms / 1000 * 0.9


def test_set_coordinator_moves_the_transaction_coordinator(cluster: MockCluster) -> None:
    transactional_id = f"tx-{uuid.uuid4().hex[:8]}"
    cluster.set_coordinator("transaction", transactional_id, 2)
    cluster.broker_down(2)
    producer = Producer(
        {
            "bootstrap.servers": cluster.bootstrap_servers,
            "transactional.id": transactional_id,
            "reconnect.backoff.ms": 50,
            "reconnect.backoff.max.ms": 200,
        }
    )
    # The coordinator is the broker that is down: the client cannot initialise.
    with pytest.raises(KafkaException):
        producer.init_transactions(1.0)

    # Moved to a live broker: the same client finds it and initialises.
    cluster.set_coordinator("transaction", transactional_id, 1)
    producer.init_transactions(10.0)


def test_refused_commands_raise_cluster_error_and_the_cluster_keeps_working(cluster: MockCluster) -> None:
    topic = new_topic(cluster)
    with pytest.raises(ClusterError, match="TOPIC_ALREADY_EXISTS"):
        cluster.create_topic(topic)
    with pytest.raises(ClusterError, match="no broker 9"):
        cluster.broker_down(9)
    with pytest.raises(ClusterError, match="replication_factor 4"):
        cluster.create_topic("too-replicated", replication_factor=4)
    with pytest.raises(ValueError, match="unknown request name"):
        cluster.push_request_errors("NotARequest", [KafkaError.INVALID_RECORD])
    with pytest.raises(ValueError, match="empty"):
        cluster.push_request_errors("Produce", [])
    with pytest.raises(ValueError, match="key_type"):
        cluster.set_coordinator("broker", "x", 1)

    assert StatsProducer(cluster).send(topic, b"still fine")[0] is None


def test_a_dead_child_is_a_clear_error() -> None:
    mock = MockCluster(brokers=1).start()
    try:
        assert mock.pid is not None
        os.kill(mock.pid, signal.SIGKILL)  # our own child
        with pytest.raises(ClusterError, match=f"exited with code {-signal.SIGKILL}"):
            mock.create_topic("t", replication_factor=1)
    finally:
        mock.stop()
    with pytest.raises(ClusterError, match="not running"):
        _ = mock.bootstrap_servers
    with pytest.raises(ClusterError, match="not running"):
        mock.broker_up(1)


def test_stop_is_clean_idempotent_and_restartable(caplog: pytest.LogCaptureFixture) -> None:
    mock = MockCluster(brokers=2)
    with pytest.raises(ClusterError, match="not running"):
        _ = mock.bootstrap_servers
    with caplog.at_level(logging.WARNING, logger="reliable_kafka.testing.mock"):
        for _ in range(2):  # a stopped cluster can be started again
            with mock:
                assert mock.bootstrap_servers.count(",") == 1  # two brokers
                with pytest.raises(ClusterError, match="already running"):
                    mock.start()
            mock.stop()
    # A non-zero exit of the child would have been logged as a warning.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_server_answers_each_command_line_and_exits_on_sigterm() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    server = subprocess.Popen(
        [sys.executable, "-m", "reliable_kafka.testing.mock_server", "--brokers", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert server.stdin is not None
        hello = json.loads(wait_for_line(server, timeout=15))
        assert hello["bootstrap_servers"].startswith("127.0.0.1:")
        answers = []
        for command in (
            {"cmd": "create_topic", "topic": "t", "partitions": 2, "replication_factor": 1},
            {"cmd": "set_leader", "topic": "t", "partition": 7, "broker_id": 1},
            {"cmd": "set_rtt", "broker_id": 1},
            "not json",
            {"cmd": "push_request_errors", "api": "EndTxn", "errors": [KafkaError.INVALID_TXN_STATE]},
        ):
            line = command if isinstance(command, str) else json.dumps(command)
            server.stdin.write(line.encode() + b"\n")
            server.stdin.flush()
            answers.append(json.loads(wait_for_line(server, timeout=10)))
        assert [a["ok"] for a in answers] == [True, False, False, False, True]
        assert "UNKNOWN_TOPIC_OR_PART" in answers[1]["error"]
        assert "rtt_ms" in answers[2]["error"]
        assert "not a JSON command" in answers[3]["error"]

        server.send_signal(signal.SIGTERM)  # our own child
        _, stderr = server.communicate(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert server.returncode == 0, stderr
    assert b"mock cluster destroyed" in stderr


@pytest.mark.parametrize("code", [KafkaError.OFFSET_METADATA_TOO_LARGE, KafkaError.GROUP_AUTHORIZATION_FAILED])
def test_a_failed_asynchronous_commit_is_retried_synchronously(cluster: MockCluster, code: int) -> None:
    """ReliableConsumer commits asynchronously in the steady state: a refused commit must not count as
    committed, and the next commit goes through the synchronous path (classifier, retries)."""
    from confluent_kafka import Consumer, TopicPartition

    from reliable_kafka.consumer import CommitPolicy, ReliableConsumer

    topic = new_topic(cluster)
    producer = StatsProducer(cluster)
    for i in range(200):
        producer.producer.produce(topic, f"m-{i}".encode())
    assert producer.producer.flush(10) == 0
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer = ReliableConsumer({"bootstrap.servers": cluster.bootstrap_servers, "group.id": group}, [topic],
                                commit=CommitPolicy(interval_s=0.05), max_batch=10, max_in_flight=10, dead_letter=None)
    handled: set[bytes] = set()
    deliveries = 0

    def handler(msg: Message) -> None:
        nonlocal deliveries
        deliveries += 1
        handled.add(msg.value() or b"")
        if deliveries == 100:
            cluster.push_request_errors("OffsetCommit", [code])  # the next commit is refused, once
        if deliveries >= 100:
            time.sleep(0.005)  # batches of 10 at 50 ms: a commit goes out between most of them
        if len(handled) == 200:
            consumer.stop()

    consumer.run(handler, stop_after=40)
    counts = consumer.stats()
    consumer.close()
    assert len(handled) == 200
    assert counts.commit_failures >= 1, counts
    reader = Consumer({"bootstrap.servers": cluster.bootstrap_servers, "group.id": group})
    try:
        committed = reader.committed([TopicPartition(topic, 0)], timeout=10)
    finally:
        reader.close()
    assert committed[0].offset == 200


def test_the_mock_refuses_a_librdkafka_it_was_not_checked_against(monkeypatch: pytest.MonkeyPatch) -> None:
    from reliable_kafka.errors import ClusterError
    from reliable_kafka.testing.mock_server import check_librdkafka_version

    monkeypatch.delenv("RK_MOCK_ANY_LIBRDKAFKA", raising=False)
    check_librdkafka_version("2.12.1")
    check_librdkafka_version("2.16.9")
    with pytest.raises(ClusterError, match=r"this is 2\.17\.0: install confluent-kafka>=2\.12,<2\.17"):
        check_librdkafka_version("2.17.0")
    monkeypatch.setenv("RK_MOCK_ANY_LIBRDKAFKA", "1")
    check_librdkafka_version("2.17.0")  # tried anyway, as asked
