"""How long a new idempotent producer takes to deliver its first message, primed (producer_id.py) or not.

    python benchmarks/first_delivery.py [ROUNDS] > out.json

Each round, in turn: a bare confluent-kafka producer with our settings that produces at once
(`unprimed`), the same after one metadata request (`one_request`), the same after
`prime_producer_id()` (`primed`), and `ReliableProducer` (durability "memory") sending at once after it
is made (`reliable_producer`: its first produce() comes after its outbox, topic guard and poller are set
up, some milliseconds after its librdkafka producer, so it does not meet the wait). The time runs from the
producer's creation to its first delivery report.
A 3-node local cluster, warmed first (eight producers' ids fetched, so that every broker has loaded its
transaction-state partitions: a broker still loading them answers "Coordinator load in progress").
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)
from confluent_kafka import Producer

from reliable_kafka import ReliableProducer
from reliable_kafka.config import producer_config
from reliable_kafka.producer_id import prime_producer_id

TOPIC = "first-delivery"
VARIANTS = ("unprimed", "one_request", "primed", "reliable_producer")


def _bare(conn: dict[str, Any], prepare: Callable[[Producer], object]) -> float:
    started = time.perf_counter()
    producer = Producer(producer_config(conn))
    prepare(producer)
    done: list[float] = []
    producer.produce(TOPIC, b"x", on_delivery=lambda err, _m: done.append(time.perf_counter()) if err is None else None)
    producer.flush(10)
    if not done:
        raise RuntimeError("the first message was not delivered within 10 s")
    return done[0] - started


def _reliable(conn: dict[str, Any]) -> float:
    started = time.perf_counter()
    with ReliableProducer(conn, durability="memory", preflight="off") as producer:
        sent = producer.send(TOPIC, b"x")
        if producer.wait(sent, timeout=10) != "delivered":
            raise RuntimeError("the first message was not delivered within 10 s")
        return time.perf_counter() - started


def main(rounds: int) -> dict[str, Any]:
    with bench_cluster() as (_cluster, conn, create_topic):
        create_topic(TOPIC, 3)
        for _ in range(8):
            _bare(conn, prime_producer_id)
        runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(rounds):
            runs["unprimed"].append(_bare(conn, lambda _p: None))
            runs["one_request"].append(_bare(conn, lambda p: p.list_topics(timeout=5)))
            runs["primed"].append(_bare(conn, prime_producer_id))
            runs["reliable_producer"].append(_reliable(conn))
    return {
        "rounds": rounds,
        "variants": {
            v: {"median_s": round(statistics.median(r), 3), "min_s": round(min(r), 3), "max_s": round(max(r), 3),
                "over_0_3_s": sum(1 for x in r if x > 0.3), "runs_s": [round(x, 3) for x in r]}
            for v, r in runs.items()
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 24), indent=1))
