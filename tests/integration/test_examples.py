"""The runnable examples, run as the user runs them, against the real cluster and a real redis-server.

Each test starts `python examples/X.py --bootstrap-servers B ...` as a subprocess and checks what it
printed against what an independent reader finds in the topics.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition

from reliable_kafka import Message, ReliableProducer
from reliable_kafka.dlq import parse_dead_letter_headers
from reliable_kafka.ids import message_id_of
from reliable_kafka.testing import LocalKafkaCluster, consume_all
from reliable_kafka.testing.gates import Feeder, fire_when, wait_for
from reliable_kafka.testing.offsets_probe import uncommitted_records
from tests.fixtures.members import MemberLogs

log = logging.getLogger(__name__)

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
UNREACHABLE = "127.0.0.1:1"  # nothing listens there: no order can be delivered before the crash


def run_example(name: str, *args: str, log: Path, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    """Run one example, its output appended to its member `log`; its exit status and the JSON line it printed last."""
    before = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as out:
        proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=ROOT, stdout=out,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)
    with open(log, "rb") as f:
        f.seek(before)
        output = f.read().decode(errors="replace")
    lines = [line for line in output.splitlines() if line.startswith("{")]
    assert lines, f"{name} printed no result (exit {proc.returncode}):\n{output[-3000:]}"
    return proc.returncode, json.loads(lines[-1])


def test_order_service_keeps_orders_through_a_crash_and_resends_them_first(
        kafka: LocalKafkaCluster, make_topic, tmp_path: Path, member_logs: MemberLogs) -> None:
    topic = make_topic(partitions=1, configs={"min.insync.replicas": 2})
    outbox = str(tmp_path / "orders.outbox")

    # Run 1 accepts 20 orders while no broker is reachable, then is SIGKILLed: no flush, no close.
    code, first = run_example("order_service.py", "--bootstrap-servers", UNREACHABLE, "--topic", topic,
                              "--outbox", outbox, "--orders", "20", "--crash",
                              log=member_logs.path("order-service"))
    assert code == -signal.SIGKILL
    assert first["accepted"] == list(range(1, 21)) and first["pending_at_start"] == 0

    # Run 2 finds them in the outbox, delivers them first, then publishes five new orders.
    code, second = run_example("order_service.py", "--bootstrap-servers", kafka.bootstrap_servers,
                               "--topic", topic, "--outbox", outbox, "--orders", "5", "--first-id", "21",
                               log=member_logs.path("order-service"))
    assert code == 0, second
    assert second["pending_at_start"] == 20
    assert second["accepted"] == list(range(21, 26))
    assert (second["failed"], second["pending_at_exit"]) == ({}, 0)

    msgs = list(consume_all(kafka.bootstrap_servers, topic))
    ids = [json.loads(m.value())["id"] for m in msgs]
    assert ids == list(range(1, 26)), "every accepted order exactly once, the crashed run's first, in order"
    assert [message_id_of(m.headers()) for m in msgs] == [f"order-{i}" for i in ids]


def _uncommitted(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, tuple[int, int]]:
    """Partitions whose committed offset is not their end offset: {partition: (committed, end)}."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        committed = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=15)
        ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
                for p in range(partitions)}
    finally:
        c.close()
    # An empty partition has nothing to commit (its committed offset stays unset).
    return {tp.partition: (tp.offset, ends[tp.partition]) for tp in committed
            if ends[tp.partition] > 0 and tp.offset != ends[tp.partition]}


def _rewind(bootstrap: str, group: str, topic: str, partitions: int) -> None:
    """What an operator's offset reset does: the whole topic is delivered to the group again."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        c.commit(offsets=[TopicPartition(topic, p, 0) for p in range(partitions)], asynchronous=False)
    finally:
        c.close()


@pytest.mark.redis
def test_dlq_consumer_charges_each_order_once_parks_poison_and_a_replay_charges_nothing(
        kafka: LocalKafkaCluster, make_topic, redis_url: str, tmp_path: Path, member_logs: MemberLogs) -> None:
    topic = make_topic(partitions=3, configs={"min.insync.replicas": 2})
    orders = list(range(1, 31))
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, outbox_path=tmp_path / "o.db") as p:
        # Every order twice with the same rk-id, as a producer re-sends after a crash. The outbox refuses an
        # id it still holds, so the second copy goes out once the first is delivered (and gone from it).
        for _ in range(2):
            p.send_many([Message(topic, json.dumps({"id": i, "total": 9.5}).encode(), key=f"c-{i % 4}".encode(),
                                 message_id=f"order-{i}") for i in orders])
            assert p.flush(30) == 0
        poison = p.send_many([Message(topic, b"{not json", key=b"c-0"),
                              Message(topic, json.dumps({"id": 99, "total": -1}).encode(), key=b"c-1")])
        assert p.flush(30) == 0
    group = f"billing-{uuid.uuid4().hex[:6]}"
    args = ["--bootstrap-servers", kafka.bootstrap_servers, "--redis-url", redis_url, "--topic", topic,
            "--group", group, "--concurrency", "2", "--idle-exit", "8", "--create-dlq"]

    code, first = run_example("dlq_consumer.py", *args, log=member_logs.path("dlq-consumer"))
    assert code == 0, first
    assert Counter(first["charged"]) == Counter(orders), "each order charged exactly once"
    assert first["gateway_timeouts"] == 6  # orders 5, 10, ..., 30 failed once, then were retried
    assert first["counts"]["duplicates_skipped"] == 30
    assert first["counts"]["dead_lettered"] == 2
    dead = list(consume_all(kafka.bootstrap_servers, f"{topic}.dlq"))
    infos = sorted((parse_dead_letter_headers(m.headers()) for m in dead), key=lambda i: i.message_id or "")
    assert sorted(m.value() for m in dead) == sorted([b"{not json", json.dumps({"id": 99, "total": -1}).encode()])
    assert [i.message_id for i in infos] == sorted(s.message_id for s in poison), "rk-id kept on the DLQ copy"
    assert all(i.topic == topic and i.attempts == 1 and i.error_type.endswith("InvalidOrder") for i in infos)
    assert _uncommitted(kafka.bootstrap_servers, group, topic, 3) == {}, "every record committed"

    # Replay the whole topic to the same group: Redis remembers every charged and parked order.
    _rewind(kafka.bootstrap_servers, group, topic, 3)
    code, replay = run_example("dlq_consumer.py", *args, log=member_logs.path("dlq-consumer"))
    assert code == 0, replay
    assert replay["charged"] == []
    assert replay["counts"]["duplicates_skipped"] == 62
    assert replay["counts"].get("dead_lettered", 0) == 0
    assert len(list(consume_all(kafka.bootstrap_servers, f"{topic}.dlq"))) == 2


def _end_offsets(client: Consumer, topic: str, partitions: int) -> int:
    """The sum of the partitions' end offsets; 0, with the reason logged, when the cluster did not say.

    `client` lives for the whole wait: a new client per look asks its first metadata of one bootstrap
    broker, and a run on a loaded host waited 90 s for 40 records the processor had published and was
    consuming (every look ended in a KafkaException, then swallowed without a word). A long-lived
    client refreshes its metadata from every broker it knows. The reason is logged now.
    """
    try:
        return sum(client.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
                   for p in range(partitions))
    except KafkaException as exc:  # not created yet, or not known yet to the broker that answered
        log.info("end offsets of %s not known yet: %s", topic, exc)
        return 0


def _payment_requests(topic: str, ids: range) -> list[Message]:
    """Requests as the example's --demo-requests publishes them (every 25th has a non-positive amount)."""
    bodies = {i: {"payment_id": f"p-{i}", "from": f"acct-{i % 7}", "to": "merchant-1",
                  "amount_cents": -5 if i % 25 == 0 else 100 * i} for i in ids}
    return [Message(topic, json.dumps(b).encode(), key=f"p-{i}".encode(), message_id=f"payment-request-{i}")
            for i, b in bodies.items()]


def _committed_total(consumer: Consumer, topic: str, partitions: int) -> int:
    """Requests the group has processed: its committed offsets on the input, summed (no group join)."""
    committed = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=15)
    return sum(max(tp.offset, 0) for tp in committed)


@pytest.mark.slow
def test_payment_processor_books_each_payment_once_through_a_sigkill(kafka: LocalKafkaCluster,
                                                                     member_logs: MemberLogs) -> None:
    run = uuid.uuid4().hex[:6]
    requests, ledger, events, group = f"pay-req-{run}", f"ledger-{run}", f"pay-done-{run}", f"payments-{run}"
    args = ["--bootstrap-servers", kafka.bootstrap_servers, "--input", requests, "--ledger-topic", ledger,
            "--events-topic", events, "--group", group, "--delay-ms", "30",
            # Entries go to the brokers as they are booked, not at the commit: the kill below is aimed
            # at an open transaction whose entries the brokers hold.
            "--linger-ms", "5"]
    count, demo = 200, 40
    valid = [f"p-{i}" for i in range(1, count + 1) if i % 25]
    member_log = member_logs.path("payment-processor")  # both runs, appended

    # Run 1 creates the topics, publishes the first requests, and is SIGKILLed mid-stream. The rest of
    # the input is fed as it works (a small backlog) and held back past `cap`, so it can never finish
    # them all before the kill, however fast it is; they are published after the kill instead.
    published, cap = demo, [count - 50]

    def top_up() -> None:
        nonlocal published
        batch = range(published + 1, min(published + 10, cap[0]) + 1)
        p.send_many(_payment_requests(requests, batch))
        assert p.flush(30) == 0
        published = batch[-1]

    def backlog() -> int:
        # Nothing more may be fed yet: report a full backlog so the feeder does not top up.
        return 10**9 if published >= cap[0] else published - _committed_total(offsets, requests, 3)

    def more_input() -> None:  # re-arm: the processor may have caught up with the held-back input
        cap[0] = min(count, cap[0] + 25)

    offsets = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group, "enable.auto.commit": False})
    with open(member_log, "ab") as out:
        first = subprocess.Popen([sys.executable, str(EXAMPLES / "payment_processor.py"), *args,
                                  "--create-topics", "--demo-requests", str(demo)],
                                 cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    p = ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, durability="memory")
    try:
        # It publishes them before it starts processing (and the topics are its own, created just before).
        assert wait_for(lambda: _end_offsets(offsets, requests, 3) >= demo, timeout_s=180,
                        poll_s=0.5), "the processor did not publish its demo requests"
        with Feeder(top_up, backlog, low=15, name="payment-requests"):
            # The kill bites when the processor has booked some payments (40 offsets on the events
            # topic) and a transaction holds ledger entries (a kill between two transactions proves
            # less); the held-back input keeps it from running out of work first.
            fire_when(lambda: (first.poll() is None and _end_offsets(offsets, events, 3) >= 40
                               and uncommitted_records(kafka.bootstrap_servers, ledger) > 0),
                      first.kill,  # SIGKILL: no commit, no abort, no goodbye
                      what="payment processor: SIGKILL in an open transaction", rearm=more_input, timeout_s=20)
        assert first.wait(10) == -signal.SIGKILL, f"the processor stopped by itself (exit {first.returncode})"
        # The rest of the input, for run 2.
        p.send_many(_payment_requests(requests, range(published + 1, count + 1)))
        assert p.flush(30) == 0
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
        p.close(10)
        offsets.close()
    # The kill came mid-stream: some payments were booked (committed), not all.
    booked_before = sum(1 for _ in consume_all(kafka.bootstrap_servers, ledger))
    assert 0 < booked_before < 2 * len(valid), f"{booked_before} ledger entries at the kill: not mid-stream"

    # Run 2, same transactional id: fences the dead incarnation, aborts its open transaction, finishes.
    code, result = run_example("payment_processor.py", *args, "--idle-exit", "5", log=member_log, timeout=180)
    assert code == 0, result

    entries = [json.loads(m.value()) for m in consume_all(kafka.bootstrap_servers, ledger)]
    booked = Counter((e["payment_id"], e["account"]) for e in entries)
    assert {n for n in booked.values()} == {1}, "a ledger entry was written twice"
    assert sorted({e["payment_id"] for e in entries}) == sorted(valid), "a payment is missing from the ledger"
    assert sum(e["delta_cents"] for e in entries) == 0, "debits and credits do not balance"
    done = Counter(json.loads(m.value())["payment_id"] for m in consume_all(kafka.bootstrap_servers, events))
    assert sorted(done) == sorted(valid) and set(done.values()) == {1}
    dead = [parse_dead_letter_headers(m.headers()) for m in consume_all(kafka.bootstrap_servers, f"{requests}.dlq")]
    assert len(dead) == count // 25 and all("non-positive amount" in d.error for d in dead), dead[:2]

    # Records of a transaction the kill left open stay in the log, hidden by read_committed. Whether
    # there are any depends on where the kill landed (the processor writes a batch into its
    # transaction just before committing it), so they are reported, not required.
    everything = sum(1 for _ in consume_all(kafka.bootstrap_servers, ledger, isolation_level="read_uncommitted"))
    assert everything >= len(entries)
    print(f"ledger: {len(entries)} committed entries, {everything - len(entries)} aborted records hidden")


def _scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    """/metrics over real HTTP, read by prometheus_client's own parser: (sample name, labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def _values(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> list[float]:
    return [v for n, ls, v in samples if n == name and all(ls.get(k) == want for k, want in labels.items())]


def test_prometheus_recipe_serves_the_metrics_of_a_run(
        kafka: LocalKafkaCluster, make_topic, member_logs: MemberLogs) -> None:
    """The recipe of docs/operations.md, run as the user runs it (its own process: the OpenTelemetry
    MeterProvider is set once per process): produce and consume, then scrape /metrics over HTTP."""
    topic, count = make_topic(partitions=3), 60
    member_log = member_logs.path("prometheus_metrics")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package, whatever the venv installed
    with open(member_log, "ab") as err:
        proc = subprocess.Popen([sys.executable, str(EXAMPLES / "prometheus_metrics.py"), "--bootstrap-servers",
                                 kafka.bootstrap_servers, "--topic", topic, "--port", "0", "--messages", str(count),
                                 "--serve-s", "120"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
    try:
        stdout = proc.stdout
        assert stdout is not None
        lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
        result = json.loads(lines.get(timeout=150))  # the JSON line: the run is over, /metrics is served
        assert result["pending"] == 0 and result["handled"] == count, result
        samples = _scrape(result["port"])
        _check_scrape(samples, result, topic, count)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, member_log.read_text()[-3000:]


def _check_scrape(samples: list[tuple[str, dict[str, str], float]], result: dict[str, Any], topic: str,
                  count: int) -> None:
    """What the scrape after the run must show; librdkafka's statistics are scraped again until they came."""
    # The producer: every message acknowledged, none failed, the outbox empty.
    assert _values(samples, "reliable_kafka_producer_accepted_total") == [count]
    delivered = [v for n, ls, v in samples if n == "messaging_client_sent_messages_total" and "error_type" not in ls]
    assert delivered == [count], "the delivered count must equal what was sent"
    assert not [v for n, ls, v in samples if n == "messaging_client_sent_messages_total" and "error_type" in ls]
    assert _values(samples, "reliable_kafka_outbox_depth") == [0]
    assert _values(samples, "reliable_kafka_outbox_failed") == [0]
    # The consumer: each record fetched once and timed once, every partition's lag 0 after its commit.
    assert _values(samples, "messaging_client_consumed_messages_total") == [count]
    assert _values(samples, "messaging_process_duration_seconds_count", messaging_destination_name=topic) == [count]
    lag = {ls["messaging_destination_partition_id"]: v for n, ls, v in samples
           if n == "reliable_kafka_consumer_lag" and ls.get("messaging_destination_name") == topic}
    assert lag == {"0": 0, "1": 0, "2": 0}, lag
    commits = _values(samples, "messaging_client_operation_duration_seconds_count", messaging_operation_name="commit")
    assert commits and commits[0] >= 1
    # librdkafka's statistics come every second (the example's statistics.interval.ms), the first a second
    # after a client started: scraped until the producer's handle reported every message sent.
    transmitted, waitresp = [], []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (transmitted and transmitted[0] >= count and waitresp):
        time.sleep(0.5)
        later = _scrape(result["port"])
        transmitted = _values(later, "reliable_kafka_rdkafka_messages_transmitted_total",
                              reliable_kafka_client_type="producer")
        waitresp = _values(later, "reliable_kafka_rdkafka_broker_waitresp", reliable_kafka_client_type="producer")
        # (A broker's rtt is reported only for an interval in which the handle sent it requests.)
        samples += [s for s in later if s[0] == "reliable_kafka_rdkafka_broker_rtt_seconds"]
    assert transmitted and transmitted[0] >= count, transmitted
    assert waitresp, "the producer's brokers are reported"
    rtts = _values(samples, "reliable_kafka_rdkafka_broker_rtt_seconds")
    assert rtts and all(0 < r < 5 for r in rtts), rtts
