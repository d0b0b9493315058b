"""The producer's parts through their own seams: the topic guard (one AdminClient, deferred checks, size
limits) with its cluster calls stubbed, and the dispatcher's handling of size refusals and failed
messages on librdkafka's mock cluster (error paths only: the mock proves no delivery guarantee).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from confluent_kafka import KafkaError

from reliable_kafka import ClusterUnreachable, TopicConfigError
from reliable_kafka.admin import TopicDurability
from reliable_kafka.producer import topic_guard
from reliable_kafka.producer.dispatcher import Dispatcher
from reliable_kafka.producer.topic_guard import TopicGuard, record_size
from reliable_kafka.spool import MemorySpool, NewMessage, OutboxRow
from reliable_kafka.testing.mock import MockCluster

pytestmark = pytest.mark.timeout(120)

BOOT = {"bootstrap.servers": "127.0.0.1:1", "sasl.username": "u", "linger.ms": 5}


def durability(topic: str, *, rf: int = 3, max_bytes: int = 1_000) -> TopicDurability:
    return TopicDurability(topic, partitions=1, replication_factor=rf, min_insync_replicas=2,
                           unclean_leader_election=False, max_message_bytes=max_bytes)


class Cluster:
    """Stands in for admin.py's calls to the cluster: counts AdminClients and describe requests."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.admins: list[tuple[str, dict[str, Any]]] = []
        self.described: list[str] = []
        self.topics: dict[str, TopicDurability] = {}
        self.unreachable = False
        monkeypatch.setattr(topic_guard, "admin_client", self._admin_client)
        monkeypatch.setattr(topic_guard, "describe_topic", self._describe)
        monkeypatch.setattr(topic_guard, "preflight", self._preflight)

    def _admin_client(self, servers: str, extra: dict[str, Any]) -> object:
        self.admins.append((servers, dict(extra)))
        return object()

    def _describe(self, admin: object, topic: str, timeout: float = 10.0) -> TopicDurability | None:
        self.described.append(topic)
        if self.unreachable:
            raise ClusterUnreachable("no broker answered")
        return self.topics.get(topic)

    def _preflight(self, admin: object, topic: str, *, mode: str, timeout: float) -> TopicDurability | None:
        found = self._describe(admin, topic, timeout)
        if found is not None and found.problems() and mode == "error":
            raise TopicConfigError(topic, found.problems())
        return found


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Cluster:
    return Cluster(monkeypatch)


def test_the_guard_opens_one_admin_client_on_first_use_and_drops_it_on_close(cluster: Cluster) -> None:
    cluster.topics = {"a": durability("a"), "b": durability("b", max_bytes=5_000)}
    guard = TopicGuard(BOOT, "error")
    assert cluster.admins == [], "a producer that never checks a topic opens no AdminClient"
    guard.preflight("a")
    guard.check(["b"])
    guard.oversized([("a", None), ("b", None)])
    assert len(cluster.admins) == 1, "one AdminClient per producer, not one per call"
    servers, settings = cluster.admins[0]
    assert servers == "127.0.0.1:1" and settings.get("sasl.username") == "u" and "linger.ms" not in settings
    assert guard.seen == {"a", "b"} and guard.limits == {"a": 1_000, "b": 5_000}
    guard.close()
    guard.preflight("a")
    assert len(cluster.admins) == 2, "close() dropped the client; a later use opens a new one"


def test_a_refused_topic_raises_and_stays_unchecked(cluster: Cluster) -> None:
    cluster.topics = {"weak": durability("weak", rf=1)}
    guard = TopicGuard(BOOT, "error")
    with pytest.raises(TopicConfigError, match="replication factor 1"):
        guard.preflight("weak")
    assert "weak" not in guard.seen, "the next send to it is checked (and refused) again"
    TopicGuard(BOOT, "warn").preflight("weak")  # warn: accepted, no exception


def test_an_unreachable_check_is_deferred_then_a_late_refusal_is_logged_not_raised(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    guard = TopicGuard(BOOT, "error")
    cluster.unreachable = True
    guard.preflight("t")  # the outbox accepts while brokers are away
    assert guard.seen == {"t"} and guard.deferred == ["t"]
    guard.retry_deferred()
    assert cluster.described == ["t"], "not retried before PREFLIGHT_RETRY_S"
    monkeypatch.setattr(topic_guard, "PREFLIGHT_RETRY_S", 0.0)
    cluster.unreachable = False
    cluster.topics = {"t": durability("t", rf=1)}
    with caplog.at_level(logging.ERROR, logger=topic_guard.__name__):
        guard.retry_deferred()
    assert guard.deferred == [] and guard.seen == {"t"}
    assert "sent anyway" in caplog.text and "replication factor 1" in caplog.text


def test_too_large_uses_the_learnt_limit_and_oversized_rereads_it_once_per_topic(cluster: Cluster) -> None:
    guard = TopicGuard(BOOT, "off")
    assert guard.too_large("t", b"x" * 10_000, None, ()) is None, "no limit known: librdkafka decides"
    cluster.topics = {"t": durability("t", max_bytes=1_000), "u": durability("u", max_bytes=100_000)}
    guard.preflight("t")
    fits = b"x" * (1_000 - record_size(b"", None, ()))
    assert guard.too_large("t", fits, None, ()) is None
    reason = guard.too_large("t", fits + b"x", None, ())
    assert reason is not None and "max.message.bytes=1000" in reason
    # The topic was altered since: the broker's refusal makes the guard read the limit again.
    cluster.topics["t"] = durability("t", max_bytes=2_000)
    cluster.described.clear()
    big = row(1, "t", b"x" * 1_500)
    small = row(2, "t", b"small")
    assert guard.oversized([("t", big), ("t", small), ("u", big), ("t", None)]) == [False, False, False, True]
    assert sorted(cluster.described) == ["t", "u"], "one describe per topic per call, not per record"
    cluster.topics["t"] = durability("t", max_bytes=1_000)
    assert guard.oversized([("t", big), ("t", small)]) == [True, False]
    cluster.unreachable = True
    assert guard.oversized([("t", small)]) == [True], "no word from the cluster: the broker's refusal stands"
    cluster.unreachable = False
    assert guard.oversized([("gone", small)]) == [True]


def row(seq: int, topic: str, value: bytes) -> OutboxRow:
    return OutboxRow(seq, f"id-{seq}", topic, None, value, (), None, "pending", 0, None, 0)


# ---- the dispatcher, on the mock cluster -----------------------------------------------------------


@pytest.fixture
def mock() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as m:
        yield m


class SizeJudge(TopicGuard):
    """A guard that says a record is too large by itself when its value starts with b"big", and
    remembers whether it was asked from inside a delivery callback."""

    def __init__(self) -> None:
        super().__init__(BOOT, "off")
        self.asked: list[list[str]] = []
        self.in_callback = False

    def oversized(self, refused: Sequence[tuple[str, OutboxRow | None]]) -> list[bool]:
        frame: FrameType | None = sys._getframe()
        while frame is not None:
            self.in_callback |= frame.f_code is Dispatcher._on_delivery.__code__
            frame = frame.f_back
        self.asked.append([r.message_id for _, r in refused if r is not None])
        return [r is None or (r.value or b"").startswith(b"big") for _, r in refused]


class NoScan(MemorySpool):
    def failed(self, limit: int | None = None) -> list[OutboxRow]:
        raise AssertionError("a failure is looked up by its seq, not by scanning every failed row")


def test_a_broker_size_refusal_is_judged_off_the_callback_and_fails_only_the_oversized_record(
        mock: MockCluster) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    mock.create_topic(topic, partitions=1, replication_factor=3)
    guard, spool = SizeJudge(), NoScan()
    failed: list[OutboxRow] = []
    # The five rows go out as one batch, the one the broker refuses: librdkafka sends a batch once it holds
    # batch.num.messages, and the long linger keeps it from sending fewer. (With linger.ms=50 a hand-over
    # descheduled on a loaded host sent m-0 alone, and only m-0 was refused and judged.)
    d = Dispatcher({"bootstrap.servers": mock.bootstrap_servers, "linger.ms": 2000, "batch.num.messages": 5},
                   spool, guard, max_in_flight=1_000, send_timeout_s=5, on_failed=failed.append)
    assert d.start() == 0
    try:
        # The broker refuses the whole batch for one record; only that one is too large by itself.
        mock.push_request_errors("Produce", [KafkaError.MSG_SIZE_TOO_LARGE])
        rows = [NewMessage(f"m-{i}", topic, b"big" if i == 2 else b"ok") for i in range(5)]
        errors: dict[int, str] = {}
        seqs = d.accept(rows, errors)
        assert errors == {}, "nothing was refused at hand-over"
        assert d.wait_until(lambda: spool.stats().pending, lambda n: n == 0, 30, 0.05) == 0
    finally:
        assert d.stop() == 0
    assert guard.asked and not guard.in_callback, "the guard was asked after poll() returned"
    assert sorted(m for asked in guard.asked for m in asked) == [f"m-{i}" for i in range(5)]
    assert [r.message_id for r in failed] == ["m-2"] and failed[0].seq == seqs[2]
    assert failed[0].state == "failed" and "MSG_SIZE_TOO_LARGE" in (failed[0].last_error or "")
    counts = d.counters.stats()
    assert counts.failed == 1 and counts.retried == 4 and counts.delivered == 4
    assert counts.sent == 5


def test_delivery_callbacks_are_reused_and_each_report_settles_its_own_message(mock: MockCluster) -> None:
    """A message's delivery callback is a slot put back by its report (report_slots.py): 3,000 messages in
    rounds of 100 are each settled once, by their own seq, from about a round's worth of slots."""
    topic = f"t-{uuid.uuid4().hex[:8]}"
    mock.create_topic(topic, partitions=3, replication_factor=3)
    spool = MemorySpool()
    d = Dispatcher({"bootstrap.servers": mock.bootstrap_servers, "linger.ms": 1}, spool,
                   TopicGuard({"bootstrap.servers": mock.bootstrap_servers}, "off"), max_in_flight=1_000,
                   send_timeout_s=5, on_failed=None)
    delivered: list[int] = []
    d.set_listener(lambda ok, _failed: delivered.extend(ok))
    assert d.start() == 0
    try:
        seqs = []
        for r in range(30):
            seqs += [d.accept_one(NewMessage(f"m-{r}-{i}", topic, b"v"))[0] for i in range(100)]
            assert d.wait_until(lambda: spool.stats().pending, lambda n: n == 0, 30, 0.01) == 0
    finally:
        assert d.stop() == 0
    assert sorted(delivered) == seqs and len(set(delivered)) == 3_000
    assert d.counters.stats().delivered == 3_000
    assert len(d._reports._free) <= 200, "slots are taken again once their report came back"


def test_the_poller_runs_on_its_own_thread_and_stop_lets_go_of_what_librdkafka_holds(silent_broker: str) -> None:
    spool = MemorySpool()
    conf = {**BOOT, "bootstrap.servers": silent_broker}
    d = Dispatcher(conf, spool, TopicGuard(conf, "off"), max_in_flight=10, send_timeout_s=5, on_failed=None)
    before = {t.name for t in threading.enumerate()}
    d.start()
    assert "reliable-kafka-producer" in {t.name for t in threading.enumerate()} - before
    seqs = d.accept([NewMessage("m-0", "t", b"v")], {})
    # len(Producer) also counts events the poller has not served yet (a config warning at creation).
    assert seqs == [1] and d.dispatched_upto == 1 and d.in_flight >= 1, "handed to librdkafka at once"
    assert d.wait_until(lambda: spool.stats().pending, lambda n: n == 0, 0.3, 0.05) == 1, "no answer"
    assert d.in_flight >= 1, "still held by librdkafka"
    assert d.stop() == 1, "still pending: it stays in the spool"
    assert d.in_flight == 0 and spool.stats().pending == 1


def test_single_sends_are_counted_at_once_and_reach_the_accepted_metric_in_sums(
    silent_broker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """send() counts itself with an int that stats() and each poll round publish (dispatcher.publish_sent):
    stats() right after the calls has every one, a commit each, and the accepted-messages metric gets the
    same total in a few adds (a poll round or a stats() each), not one per message. send_many() still
    counts its batch as one commit."""
    from reliable_kafka import telemetry
    from reliable_kafka.producer import ReliableProducer

    added: list[int] = []
    monkeypatch.setattr(telemetry.accepted, "add", lambda n, *_a, **_k: added.append(n))
    p = ReliableProducer({**BOOT, "bootstrap.servers": silent_broker}, outbox_path=tmp_path / "o.db",
                         preflight="off")
    try:
        for i in range(500):
            p.send("t", b"v-%d" % i)
        stats = p.stats()
        assert (stats.sent, stats.commits) == (500, 500), "every send() counted before any delivery"
        p.send_many([("t", b"a"), ("t", b"b")])
        p.send("t", b"c")
        stats = p.stats()
        assert (stats.sent, stats.commits) == (503, 502)
        assert sum(added) == 503 and len(added) < 100, "published in sums, not one add per send()"
    finally:
        assert p.close(timeout=0) == 503, "nothing was delivered: everything stays pending"


def test_priming_a_producer_id_without_an_answer_gives_up_within_its_time_and_raises_nothing(
    silent_broker: str,
) -> None:
    from confluent_kafka import Producer

    from reliable_kafka.producer_id import prime_producer_id

    producer = Producer({"bootstrap.servers": silent_broker, "enable.idempotence": True, "log_level": 0})
    started = time.monotonic()
    assert prime_producer_id(producer, timeout_s=0.3) is False
    assert time.monotonic() - started < 2.0, "priming must be bounded by its timeout"


def test_memory_spool_pending_after_a_seq_skips_to_it_and_leaves_out_what_was_settled() -> None:
    spool = MemorySpool()
    seqs = spool.append([NewMessage(f"id-{i}", "t", b"v") for i in range(10)])
    assert seqs == list(range(1, 11))
    spool.mark_delivered([3, 4, 8])
    spool.mark_failed(9, "refused")
    assert [r.seq for r in spool.pending()] == [1, 2, 5, 6, 7, 10]
    assert [r.seq for r in spool.pending(after_seq=4, limit=2)] == [5, 6]
    assert [r.seq for r in spool.pending(after_seq=7)] == [10]
    assert spool.pending(after_seq=10) == []
