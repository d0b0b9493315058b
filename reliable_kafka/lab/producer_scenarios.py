"""Lab scenarios where the producer side loses messages (seeds 000, 001, 003; failure modes L1, L2, L4).

Each runs the fault on an unsafe control client and on ReliableProducer against the same cluster.
"""

from __future__ import annotations

import logging
import random
import subprocess
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from reliable_kafka.errors import TopicConfigError
from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import StreamProgress, bare_produce, count, run_program, topic_name
from reliable_kafka.producer import ReliableProducer
from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.faults import (
    bounce_leader_mid_stream,
    followers_paused,
    hard_bounce_leader,
    isolated_leader,
    leader_ahead,
    sigkill_producer_mid_stream,
    until_it_bites,
)
from reliable_kafka.testing.gates import fire_when, wait_for

log = logging.getLogger(__name__)

_ACKS1: dict[str, Any] = {"acks": "1", "enable.idempotence": False, "message.timeout.ms": 20_000}


def _values(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def _reliable(cluster: LocalKafkaCluster, workdir: Path, name: str) -> ReliableProducer:
    return ReliableProducer({**cluster.client_config(), "message.timeout.ms": 120_000},
                            outbox_path=workdir / f"{name}.db")


def _on_the_quorum(cluster: LocalKafkaCluster) -> list[list[int]]:
    """Replicas on three KRaft voters, for the recipes that pause both followers (faults.followers_paused):
    two paused voters of three leave the controller without a quorum, so it cannot shrink the ISR to the
    leader alone. On the lab's 5-node cluster Kafka may place followers on the broker-only nodes, and
    then it did: the killed leader had no eligible successor (acks1-leader-loss waited 60 s for a
    leader) and acks=all was refused at once (leader-pause's freeze gate never held), in one lab run."""
    return [cluster.controller_ids[:3]]


def acks1_leader_loss(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """Seed 000: the leader acknowledges alone (followers stalled), then dies; a follower takes over."""
    name = "acks1-leader-loss"
    conn = cluster.client_config()
    out = []
    runs = 0

    def control() -> ScenarioResult:
        # Whether the recipe bit shows only in the count (see faults.followers_paused): a run that lost
        # nothing is re-armed on a fresh topic, at most three runs, each logged.
        nonlocal runs
        runs += 1
        started = time.monotonic()
        ctopic = topic_name(name, CONTROL)
        cluster.create_topic(ctopic, configs={"min.insync.replicas": 1}, assignment=_on_the_quorum(cluster))
        with isolated_leader(cluster, ctopic):
            acked = bare_produce(conn, ctopic, _values("c", 2000), **_ACKS1)
        return count(name, CONTROL, acked, conn, ctopic, started, f"run {runs} of the recipe")

    progress("control: leader isolated, acks=1", 0.1)
    out.append(until_it_bites(control, lambda r: r.lost > 0, what=f"{name}: control"))

    started = time.monotonic()
    rtopic = topic_name(name, RELIABLE)
    cluster.create_topic(rtopic, configs={"min.insync.replicas": 2}, assignment=_on_the_quorum(cluster))
    progress("reliable_kafka: leader isolated, acks=all", 0.55)
    values = _values("r", 2000)
    with tempfile.TemporaryDirectory() as d, _reliable(cluster, Path(d), name) as p:
        # Preflight and a first batch before the fault, while the cluster answers: with two of three
        # controllers paused no producer id can be handed out, and without one nothing reaches the leader.
        p.check_topics([rtopic])
        p.send_many([(rtopic, v) for v in values[:200]])
        p.flush(60)
        with isolated_leader(cluster, rtopic):
            for i in range(200, len(values), 200):
                p.send_many([(rtopic, v) for v in values[i:i + 200]])
        p.flush(120)
    out.append(count(name, RELIABLE, values, conn, rtopic, started))
    return out


def leader_hard_bounce(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """The partition leader is SIGKILLed three times while a stream is produced, and restarted.

    Each kill waits until the stream is in progress (2,000 of its records acknowledged, more to come);
    then the followers stall (paused) and the kill waits until 2,000 more records reached the leader
    alone, as a follower's long GC pause leaves a cluster. The streams are paced (5,000 messages/s,
    4 s a round) so the gates have a window to see. Both clients get the same fault.
    """
    name = "leader-hard-bounce"
    conn = cluster.client_config()
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
                if producer is None:
                    acked += _control_bounce(cluster, topic, f"{client[0]}{round_}")
                else:
                    sent += _reliable_bounce(cluster, topic, producer, f"{client[0]}{round_}")
                cluster.wait_healthy()
            if producer is not None:
                producer.flush(120)
                producer.close()
                acked = sent
        out.append(count(name, client, acked, conn, topic, started))
    return out


_RATE = 5_000  # messages/s of each bounce round's stream: 4 s for its 20,000


def _chunk(prefix: str, n: int) -> list[bytes]:
    return _values(f"{prefix}-{n}", 20_000)


def _reliable_bounce(cluster: LocalKafkaCluster, topic: str, p: ReliableProducer, prefix: str) -> list[bytes]:
    """ReliableProducer streams while its leader is killed: in progress = 2,000 of this stream's records
    confirmed, more in flight. Returns what it accepted."""
    return bounce_leader_mid_stream(
        cluster, topic, lambda b: p.send_many([(topic, v) for v in b]), partial(_chunk, prefix), rate=_RATE,
        confirmed=lambda: p.stats().delivered, at_least=2_000, unconfirmed=lambda: p.pending > 0,
        stall_followers=True)


def _control_bounce(cluster: LocalKafkaCluster, topic: str, prefix: str) -> list[bytes]:
    """The control streams with acks=1 while its leader is killed under it; what it had acknowledged.

    The kill is aimed by the stream's own delivery reports, not by the partition's high watermark: the
    watermark moves only as followers fetch, so a follower that lags (as after `unclean-election`, while
    a restarted broker still loads) kept it still while the leader acknowledged the whole stream. The
    followers stall once 2,000 are acknowledged; the kill waits for 2,000 more, which only the leader has.
    """
    conn = cluster.client_config()
    streams: list[tuple[StreamProgress, threading.Thread]] = []

    def stream() -> None:
        prog = StreamProgress()
        values = _values(f"{prefix}-{len(streams)}", 20_000)
        t = threading.Thread(target=bare_produce, args=(conn, topic, values),
                             kwargs={"rate": _RATE, "progress": prog, **_ACKS1}, daemon=True,
                             name=f"control-stream-{len(streams)}")
        streams.append((prog, t))
        t.start()

    def in_progress() -> bool:
        # The leader has acknowledged 2,000 of this stream's records and 6,000 or more are still to be
        # produced: enough for the 2,000 that the stalled followers must miss before the kill.
        prog, _ = streams[-1]
        return len(prog.acked) >= 2_000 and prog.produced <= prog.total - 6_000

    def rearm() -> None:
        prog, t = streams[-1]
        log.info("%s: control stream %d at %d produced, %d acknowledged of %d (running: %s)", topic,
                 len(streams) - 1, prog.produced, len(prog.acked), prog.total, t.is_alive())
        if prog.produced > prog.total - 6_000:  # the window passed (e.g. acks came in one burst): a fresh stream
            stream()

    try:
        stream()
        hard_bounce_leader(cluster, topic, when=in_progress, rearm=rearm, timeout_s=20,
                           followers_behind=lambda: len(streams[-1][0].acked), behind_by=2_000)
    finally:
        for _, t in streams:
            t.join(120)
    return [v for prog, _ in streams for v in prog.acked]


def leader_pause(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """Seed 000's lost session: the leader freezes (SIGSTOP) past the session timeout while its
    followers are behind; it is fenced, a follower is elected, and on resume it truncates."""
    name = "leader-pause"
    progress(f"{CONTROL}: followers behind, then the leader freezes", 0.0)
    runs = 0

    def control() -> ScenarioResult:
        # As for acks1-leader-loss, whether it bit shows only in the count: re-armed, bounded, logged.
        nonlocal runs
        runs += 1
        return _leader_pause_once(cluster, name, CONTROL, f"run {runs} of the recipe")

    out = [until_it_bites(control, lambda r: r.lost > 0, what=f"{name}: control")]
    progress(f"{RELIABLE}: followers behind, then the leader freezes", 0.5)
    out.append(_leader_pause_once(cluster, name, RELIABLE))
    return out


def _leader_pause_once(cluster: LocalKafkaCluster, name: str, client: str, detail: str = "") -> ScenarioResult:
    conn = cluster.client_config()
    started = time.monotonic()
    topic = topic_name(name, client)
    cluster.create_topic(topic, configs={"min.insync.replicas": 1 if client == CONTROL else 2},
                         assignment=_on_the_quorum(cluster))
    values = _values(client[0], 2000)
    with tempfile.TemporaryDirectory() as d:
        producer = _reliable(cluster, Path(d), name) if client == RELIABLE else None
        if producer is not None:
            # A first batch while the cluster answers (see acks1_leader_loss: a producer id is needed).
            producer.check_topics([topic])
            producer.send_many([(topic, v) for v in values[:200]])
            producer.flush(60)
        with followers_paused(cluster, topic) as iso:
            if producer is None:
                acked = bare_produce(conn, topic, values, **_ACKS1)
            else:
                for i in range(200, len(values), 200):
                    producer.send_many([(topic, v) for v in values[i:i + 200]])
            # The freeze bites once the leader's log holds records its followers' do not (ours: still
            # unconfirmed, as acks=all cannot complete without the followers).
            p = producer
            fire_when(lambda: leader_ahead(cluster, topic, iso) and (p is None or p.pending > 0),
                      lambda: cluster.pause(iso.leader), what=f"{name} ({client}): freeze the leader", timeout_s=30)
        try:
            cluster.wait_for_leader(topic, not_on=iso.leader, timeout=60)
        finally:
            time.sleep(1.0)
            cluster.resume(iso.leader)
        cluster.wait_healthy()
        if producer is not None:
            producer.flush(120)
            producer.close()
            acked = values
    return count(name, client, acked, conn, topic, started, detail)


def unclean_election(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    """Seeds 001/003: min.insync.replicas=1 with unclean election on: even acks=all loses.

    Needs two broker-only nodes (ids 4 and 5) so the replicas can fail without the KRaft quorum.
    Replicas are [4, 5, 1]: node 1 falls out of sync, acks=all is acknowledged by 4 and 5, both die,
    node 1 comes back and (unclean) becomes leader without the acknowledged records.
    """
    name = "unclean-election"
    conn = cluster.client_config()
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
                    conf: dict[str, Any] = {"acks": "all", "enable.idempotence": True}
                    acked = bare_produce(conn, topic, values, **conf)
                else:
                    producer.send_many([(topic, v) for v in values])
                    producer.flush(60)
                cluster.kill(4)
                cluster.kill(5)
            finally:
                cluster.resume(1)
            # Node 1 can be elected once it is registered again (its broker session renewed), while the
            # replicas that had the records are dead: the control's topic elects it then, uncleanly;
            # ours (unclean off) stays leaderless until 4 and 5 return.
            if not wait_for(lambda: 1 in cluster.registered_brokers(), timeout_s=60, poll_s=0.2):
                raise RuntimeError("node 1 did not register again after its resume")
            if producer is None:
                cluster.wait_for_leader(topic, timeout=60)  # node 1, uncleanly
            cluster.start_node(4, wait=False)
            cluster.start_node(5, wait=False)
            cluster.wait_healthy(timeout=120)
            if producer is not None:
                producer.flush(60)
                producer.close()
                acked = values
        out.append(count(name, client, acked, conn, topic, started, detail))
    return out


def producer_crash(cluster: LocalKafkaCluster, progress: Progress, *, kills: int = 5, messages: int = 30_000,
                   between: tuple[int, int] = (1_000, 5_000)) -> list[ScenarioResult]:
    """Seed 001: the producing process dies (SIGKILL) with messages in its buffer, `kills` times, each after
    a random `between` more of its `messages` were accepted (a test runs it smaller than the lab does)."""
    name = "producer-crash"
    out = []
    rng = random.Random(5)
    for client in (CONTROL, RELIABLE):
        progress(f"{client}: {kills} SIGKILLs", 0.5 if client == RELIABLE else 0)
        out.append(_producer_crash_once(cluster, name, client, rng, kills=kills, messages=messages, between=between))
    return out


def _producer_crash_once(cluster: LocalKafkaCluster, name: str, client: str, rng: random.Random, *, kills: int,
                         messages: int, between: tuple[int, int]) -> ScenarioResult:
    conn = cluster.client_config()
    started = time.monotonic()
    topic = topic_name(name, client)
    # What is lost here is the killed client's buffer, not a replica: the lab's 3 nodes replicate the
    # topic 3 times, a smaller cluster (a test's) as often as it can.
    cluster.create_topic(topic, 3, min(3, len(cluster.nodes)))
    mode = "reliable" if client == RELIABLE else "control"
    with tempfile.TemporaryDirectory() as d:
        ledger, status = Path(d) / "ledger", Path(d) / "status"

        def start(first: int) -> subprocess.Popen[bytes]:
            return run_program("reliable_kafka.lab.programs.producer_proc", [
                "--mode", mode, "--topic", topic, "--outbox", str(Path(d) / "outbox.db"),
                "--start", str(first), "--end", str(messages), "--ledger", str(ledger), "--status", str(status),
                # Ours sends as applications do, one send() per message, every other batch in one send_many().
                *(["--mix"] if mode == "reliable" else [])], conn)

        # A random point mid-stream, by progress rather than time (a fast client would otherwise
        # finish before its kills): `between` more accepted, some of them not yet delivered.
        crashes = sigkill_producer_mid_stream(start, ledger, status, kills=kills, between=between, rng=rng,
                                              what=f"{name} ({client})")
    acked = [f"v-{i}".encode() for i in crashes.accepted]
    return count(name, client, acked, conn, topic, started, f"{crashes.kills} SIGKILLs")


SCENARIOS = [
    Scenario("acks1-leader-loss", "L1 acks=1 leader loss: the leader acknowledges alone and dies", acks1_leader_loss),
    Scenario("unclean-election", "L2 min ISR 1 + unclean election: even acks=all loses",
             unclean_election, needs=("5-node cluster",)),
    Scenario("leader-hard-bounce", "L1 leader hard bounce: the partition leader is SIGKILLed 3 times mid-stream",
             leader_hard_bounce),
    Scenario("leader-pause", "L1 leader pause: the leader freezes past its session timeout and truncates",
             leader_pause),
    Scenario("producer-crash", "L4 producer crash: the producing process is SIGKILLed 5 times", producer_crash),
]
