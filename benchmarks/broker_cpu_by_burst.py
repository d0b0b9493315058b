"""The brokers' CPU per message against how many messages reach librdkafka at once, with and without an
rk-id header: a raw confluent-kafka producer with our settings (producer_config()) and a delivery callback,
paced to one rate.

    python benchmarks/broker_cpu_by_burst.py MESSAGES RATE BURST:h|n [BURST:h|n ...] > out.txt

Every `1 / RATE * BURST` seconds the producer calls produce() BURST times back to back (h: each message
with an rk-id header), a poller thread serving the delivery reports; the brokers' CPU is read from /proc.
A 3-node local cluster; the first case runs once more first, unmeasured.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)
from confluent_kafka import Producer

from reliable_kafka.config import producer_config
from reliable_kafka.ids import ID_HEADER, new_id

VALUE = b"x" * 100


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def paced(connection: dict[str, Any], topic: str, n: int, burst: int, headers: bool, rate: float) -> float:
    p = Producer(producer_config(connection))
    stop = threading.Event()
    delivered = [0]

    def report(err: Any, _msg: Any) -> None:
        if err is None:
            delivered[0] += 1

    def serve() -> None:
        while not stop.is_set():
            p.poll(0.05)

    poller = threading.Thread(target=serve, daemon=True)
    poller.start()
    start = next_at = time.perf_counter()
    sent = 0
    while sent < n:
        for _ in range(min(burst, n - sent)):
            if headers:
                p.produce(topic, VALUE, None, -1, report, None, 0, [(ID_HEADER, new_id().encode())])
            else:
                p.produce(topic, VALUE, None, -1, report, None, 0)
        sent += burst
        next_at += burst / rate
        time.sleep(max(0.0, next_at - time.perf_counter()))
    left = p.flush(60)
    took = time.perf_counter() - start
    stop.set()
    poller.join()
    if left or delivered[0] != n:
        raise RuntimeError(f"{delivered[0]} of {n} messages delivered")
    return took


def main() -> None:
    n, rate = int(sys.argv[1]), float(sys.argv[2])
    cases = [(int(b), h == "h") for b, h in (c.split(":") for c in sys.argv[3:])]
    with bench_cluster() as (cluster, conn, create):
        brokers = [node.proc.pid for node in cluster.nodes.values() if node.proc is not None]
        for i, (burst, headers) in enumerate([cases[0], *cases]):
            topic = f"burst-{uuid.uuid4().hex[:8]}"
            create(topic, 3)
            before = sum(cpu_s(p) for p in brokers)
            took = paced(conn, topic, n, burst, headers, rate)
            used = sum(cpu_s(p) for p in brokers) - before
            print(f"{'warm-up ' if i == 0 else ''}bursts of {burst}, rk-id header {headers}: {n / took:,.0f} msgs/s, "
                  f"brokers {used / n * 1e6:.1f} us/msg", flush=True)


if __name__ == "__main__":
    main()
