"""Lab scenario `consumer-crash` (seed 001, failure mode L6): the consuming process dies mid-batch.

The auto-commit control has already committed records it never handled, so they are skipped for
good; ReliableConsumer commits only handled records, so a crash redelivers instead of skipping.
"""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka import Producer

from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import ledger_entries, result_from, run_program, topic_name
from reliable_kafka.testing.cluster import LocalKafkaCluster

KILLS = 5
MESSAGES = 20_000


def _fill(bootstrap: str, topic: str, n: int) -> list[bytes]:
    from reliable_kafka.ids import ID_HEADER, new_ids

    values = [f"v-{i}".encode() for i in range(n)]
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 10})
    for v, mid in zip(values, new_ids(n), strict=True):
        while True:
            try:
                p.produce(topic, v, headers=[(ID_HEADER, mid.encode())])
                break
            except BufferError:
                p.poll(0.05)
    p.flush(60)
    return values


def run(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    name = "consumer-crash"
    bs = cluster.bootstrap_servers
    rng = random.Random(9)
    out = []
    for client in (CONTROL, RELIABLE):
        started = time.monotonic()
        topic = topic_name(name, client)
        cluster.create_topic(topic, 3, 3)
        values = _fill(bs, topic, MESSAGES)
        group = f"lab-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory() as d:
            ledger = Path(d) / "ledger"
            kills = 0
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                progress(f"{client}: kill {kills}/{KILLS}", (0.5 if client == RELIABLE else 0) + kills / 12)
                child = run_program("reliable_kafka.lab.programs.consumer_proc", [
                    "--mode", "reliable" if client == RELIABLE else "control", "--bootstrap", bs,
                    "--topic", topic, "--group", group, "--ledger", str(ledger), "--sleep-ms", "0.5",
                    "--instance-id", "lab-member", "--idle", "5"])
                if kills < KILLS:
                    time.sleep(rng.uniform(1.5, 3.0))
                    if child.poll() is None:
                        child.kill()
                        child.wait()
                        kills += 1
                        continue
                child.wait(timeout=180)
                break
            seen = ledger_entries(ledger)
        out.append(result_from(name, client, values, seen, started, f"{kills} SIGKILLs; slow handler"))
    return out


SCENARIO = Scenario("consumer-crash", "the consuming process is SIGKILLed 5 times mid-batch (seed 001)", run)
