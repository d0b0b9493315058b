"""Lab scenarios where the producer side loses messages (seeds 000, 001, 003; failure modes L1, L2, L4).

Each runs the fault on an unsafe control client and on ReliableProducer against the same cluster.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from reliable_kafka.errors import TopicConfigError
from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import bare_produce, count, run_program, topic_name
from reliable_kafka.producer import ReliableProducer
from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.faults import hard_bounce_leader, isolated_leader

_ACKS1: dict[str, Any] = {"acks": "1", "enable.idempotence": False, "message.timeout.ms": 20_000}


def _values(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def _reliable(cluster: LocalKafkaCluster, workdir: Path, name: str) -> ReliableProducer:
    return ReliableProducer({"bootstrap.servers": cluster.bootstrap_servers, "message.timeout.ms": 120_000},
                            outbox_path=workdir / f"{name}.db")


def acks1_leader_loss(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """Seed 000: the leader acknowledges alone (followers stalled), then dies; a follower takes over."""
    name = "acks1-leader-loss"
    bs = cluster.bootstrap_servers
    out = []
    started = time.monotonic()
    ctopic = topic_name(name, CONTROL)
    cluster.create_topic(ctopic, 1, 3, {"min.insync.replicas": 1})
    progress("control: leader isolated, acks=1", 0.1)
    with isolated_leader(cluster, ctopic):
        acked = bare_produce(bs, ctopic, _values("c", 2000), **_ACKS1)
    out.append(count(name, CONTROL, acked, bs, ctopic, started))

    started = time.monotonic()
    rtopic = topic_name(name, RELIABLE)
    cluster.create_topic(rtopic, 1, 3, {"min.insync.replicas": 2})
    progress("reliable_kafka: leader isolated, acks=all", 0.55)
    values = _values("r", 2000)
    with tempfile.TemporaryDirectory() as d, _reliable(cluster, Path(d), name) as p:
        p.check_topics([rtopic])  # preflight before the fault, while the cluster answers
        with isolated_leader(cluster, rtopic):
            for i in range(0, len(values), 200):
                p.send_many([(rtopic, v) for v in values[i:i + 200]])
        p.flush(120)
    out.append(count(name, RELIABLE, values, bs, rtopic, started))
    return out


def _collect(box: list[list[bytes]], bs: str, topic: str, values: list[bytes]) -> None:
    # 10,000 messages/s: the 20,000 of a round take 2 s, so the kill 0.3 s in lands mid-stream.
    box.append(bare_produce(bs, topic, values, rate=10_000, **_ACKS1))


def leader_hard_bounce(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """The partition leader is SIGKILLed three times while a stream is produced, and restarted."""
    name = "leader-hard-bounce"
    bs = cluster.bootstrap_servers
    out = []
    for client in (CONTROL, RELIABLE):
        started = time.monotonic()
        topic = topic_name(name, client)
        cluster.create_topic(topic, 1, 3, {"min.insync.replicas": 1 if client == CONTROL else 2})
        acked: list[bytes] = []
        sent: list[bytes] = []
        with tempfile.TemporaryDirectory() as d:
            producer = _reliable(cluster, Path(d), name) if client == RELIABLE else None
            for round_ in range(3):
                progress(f"{client}: bounce {round_ + 1}/3", (0.5 if client == RELIABLE else 0) + round_ / 6)
                values = _values(f"{client[0]}{round_}", 20_000)
                if producer is None:
                    # The control streams with acks=1 while its leader is killed under it.
                    box: list[list[bytes]] = []
                    t = threading.Thread(target=_collect, args=(box, bs, topic, values))
                    t.start()
                    time.sleep(0.3)
                    hard_bounce_leader(cluster, topic)
                    t.join(120)
                    acked += box[0] if box else []
                else:
                    producer.send_many([(topic, v) for v in values[:10_000]])
                    hard_bounce_leader(cluster, topic)
                    producer.send_many([(topic, v) for v in values[10_000:]])
                    sent += values
                cluster.wait_healthy()
            if producer is not None:
                producer.flush(120)
                producer.close()
                acked = sent
        out.append(count(name, client, acked, bs, topic, started))
    return out


def leader_pause(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """Seed 000's lost session: the leader freezes (SIGSTOP) past the session timeout while its
    followers are behind; it is fenced, a follower is elected, and on resume it truncates."""
    name = "leader-pause"
    bs = cluster.bootstrap_servers
    out = []
    for client in (CONTROL, RELIABLE):
        started = time.monotonic()
        topic = topic_name(name, client)
        cluster.create_topic(topic, 1, 3, {"min.insync.replicas": 1 if client == CONTROL else 2})
        leader = cluster.wait_for_leader(topic)
        state = cluster.partition_state(topic)
        if state is None:
            raise RuntimeError(f"no metadata for {topic}")
        followers = [r for r in state.replicas if r != leader]
        values = _values(client[0], 2000)
        progress(f"{client}: followers behind, then the leader freezes", 0.0 if client == CONTROL else 0.5)
        with tempfile.TemporaryDirectory() as d:
            producer = _reliable(cluster, Path(d), name) if client == RELIABLE else None
            if producer is not None:
                producer.check_topics([topic])
            for f in followers:
                cluster.pause(f)
            try:
                if producer is None:
                    acked = bare_produce(bs, topic, values, **_ACKS1)
                else:
                    for i in range(0, len(values), 200):
                        producer.send_many([(topic, v) for v in values[i:i + 200]])
                    time.sleep(1.0)
                cluster.pause(leader)
            finally:
                for f in followers:
                    cluster.resume(f)
            try:
                cluster.wait_for_leader(topic, not_on=leader, timeout=60)
            finally:
                time.sleep(1.0)
                cluster.resume(leader)
            cluster.wait_healthy()
            if producer is not None:
                producer.flush(120)
                producer.close()
                acked = values
        out.append(count(name, client, acked, bs, topic, started))
    return out


def unclean_election(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """Seeds 001/003: min.insync.replicas=1 with unclean election on: even acks=all loses.

    Needs two broker-only nodes (ids 4 and 5) so the replicas can fail without the KRaft quorum.
    Replicas are [4, 5, 1]: node 1 falls out of sync, acks=all is acknowledged by 4 and 5, both die,
    node 1 comes back and (unclean) becomes leader without the acknowledged records.
    """
    name = "unclean-election"
    bs = cluster.bootstrap_servers
    if len(cluster.nodes) < 5:
        raise RuntimeError("unclean-election needs a cluster with 5 nodes (3 controllers + 2 brokers)")
    out = []
    weak = {"min.insync.replicas": 1, "unclean.leader.election.enable": True}
    for client in (CONTROL, RELIABLE):
        started = time.monotonic()
        progress(f"{client}: out-of-sync replica elected", 0.0 if client == CONTROL else 0.5)
        topic = topic_name(name, client)
        detail = ""
        if client == RELIABLE:
            # Preflight refuses the weak topic outright...
            cluster.create_topic(topic + "-weak", configs=weak, assignment=[[4, 5, 1]])
            with tempfile.TemporaryDirectory() as d, _reliable(cluster, Path(d), name) as p:
                try:
                    p.check_topics([topic + "-weak"])
                    detail = "preflight did NOT refuse the weak topic; "
                except TopicConfigError as exc:
                    detail = f"preflight refused the weak topic ({'; '.join(exc.problems)[:60]}...); "
            # ...and on a safe topic (min ISR 2, unclean off) the same fault loses nothing.
            cluster.create_topic(topic, configs={"min.insync.replicas": 2}, assignment=[[4, 5, 1]])
            detail += "same fault on min.insync.replicas=2"
        else:
            cluster.create_topic(topic, configs=weak, assignment=[[4, 5, 1]])
        values = _values(client[0], 2000)
        with tempfile.TemporaryDirectory() as d:
            producer = _reliable(cluster, Path(d), name) if client == RELIABLE else None
            if producer is not None:
                producer.check_topics([topic])
            cluster.pause(1)
            try:
                cluster.wait_isr(topic, 0, {4, 5}, timeout=60)
                if producer is None:
                    acked = bare_produce(bs, topic, values, acks="all", **{"enable.idempotence": True})
                else:
                    producer.send_many([(topic, v) for v in values])
                    producer.flush(60)
                cluster.kill(4)
                cluster.kill(5)
            finally:
                cluster.resume(1)
            if producer is None:
                cluster.wait_for_leader(topic, timeout=60)  # node 1, uncleanly
            time.sleep(2.0)
            cluster.start_node(4, wait=False)
            cluster.start_node(5, wait=False)
            cluster.wait_healthy(timeout=120)
            if producer is not None:
                producer.flush(60)
                producer.close()
                acked = values
        out.append(count(name, client, acked, bs, topic, started, detail))
    return out


def producer_crash(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """Seed 001: the producing process dies (SIGKILL) with messages in its buffer, five times."""
    name = "producer-crash"
    bs = cluster.bootstrap_servers
    out = []
    rng = random.Random(5)
    for client in (CONTROL, RELIABLE):
        started = time.monotonic()
        topic = topic_name(name, client)
        cluster.create_topic(topic, 3, 3)
        total = 30_000
        with tempfile.TemporaryDirectory() as d:
            ledger = Path(d) / "ledger"
            ledger.touch()
            kills = 0
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                accepted = [int(x) for x in ledger.read_text().split()]
                start = max(accepted) + 1 if accepted else 0
                progress(f"{client}: kill {kills}/5", (0.5 if client == RELIABLE else 0) + kills / 12)
                child = run_program("reliable_kafka.lab.programs.producer_proc", [
                    "--mode", "reliable" if client == RELIABLE else "control", "--bootstrap", bs, "--topic", topic,
                    "--outbox", str(Path(d) / "outbox.db"), "--start", str(start), "--end", str(total),
                    "--ledger", str(ledger)])
                if kills < 5:
                    # A random point mid-stream, by progress rather than time (a fast client would
                    # otherwise finish before its five kills): 1,000-5,000 more accepted messages.
                    target = len(accepted) + rng.randint(1_000, 5_000)
                    waited = time.monotonic()
                    while (ledger.read_bytes().count(b"\n") < target and child.poll() is None
                           and time.monotonic() - waited < 60):
                        time.sleep(0.005)
                    if child.poll() is None:
                        child.kill()
                        child.wait()
                        kills += 1
                        continue
                child.wait(timeout=180)
                break
            acked = [f"v-{int(x)}".encode() for x in ledger.read_text().split()]
        out.append(count(name, client, acked, bs, topic, started, f"{kills} SIGKILLs"))
    return out


SCENARIOS = [
    Scenario("acks1-leader-loss", "acks=1: the leader acknowledges alone and dies (seed 000)", acks1_leader_loss),
    Scenario("unclean-election", "min ISR 1 + unclean election: even acks=all loses (seeds 001, 003)",
             unclean_election, needs=("5-node cluster",)),
    Scenario("leader-hard-bounce", "the partition leader is SIGKILLed 3 times mid-stream", leader_hard_bounce),
    Scenario("leader-pause", "the leader freezes past its session timeout and truncates (seed 000)", leader_pause),
    Scenario("producer-crash", "the producing process is SIGKILLed 5 times (seed 001)", producer_crash),
]
