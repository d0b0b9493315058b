"""Where an exactly_once Spark task's librdkafka CPU goes: each thread's CPU per row of a transactional
producer with the writer's settings (WriterOptions.producer_settings), fed as the writer feeds it.

    python benchmarks/rdkafka_thread_cpu.py [ROWS] [ROUNDS] [LINGER_MS ...] > out.json

One process, one transaction per run: ROWS rows of 100 bytes with an rk-id header, positional produce()
calls, the Kafka partition changing every STICKY_ROWS rows as the writer's rule does, poll(0) after every
10,000 rows (one Arrow batch), commit_transaction() at the end. Each thread's user+system CPU is read from
/proc/self/task before and after; librdkafka's broker threads are named rdk:broker<id>. A 3-node local
cluster, a 4-partition topic; the first linger runs once first, unmeasured.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)
from confluent_kafka import Producer

from reliable_kafka.bench.common import round_order
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.spark.options import writer_options
from reliable_kafka.spark.writer import STICKY_ROWS

PIECE = 10_000  # rows per Arrow batch, Spark's spark.sql.execution.arrow.maxRecordsPerBatch default


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed)."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def one_run(settings: dict[str, Any], topic: str, rows: int) -> dict[str, Any]:
    p = Producer(settings)
    p.init_transactions(30)
    p.begin_transaction()
    value, prefix, produce = b"x" * 100, b"bench-0123456789ab:0:", p.produce
    before, start = thread_cpu(), time.perf_counter()
    for first in range(0, rows, PIECE):
        for i in range(first, min(rows, first + PIECE)):
            produce(topic, value, None, (i // STICKY_ROWS) % 4, None, None, 0, {ID_HEADER: b"%s%d" % (prefix, i)})
        p.poll(0)
    p.commit_transaction(60)
    elapsed, after = time.perf_counter() - start, thread_cpu()
    per_row = {n: round((after[n] - before.get(n, 0.0)) / rows * 1e6, 2) for n in after}
    return {
        "rows_per_s": round(rows / elapsed),
        "cpu_us_per_row": {n: us for n, us in sorted(per_row.items(), key=lambda kv: -kv[1]) if us > 0},
        "cpu_us_per_row_total": round(sum(per_row.values()), 2),
    }


def main(rows: int, rounds: int, lingers: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": rows, "rounds": rounds, "runs": []}
    with bench_cluster() as (_cluster, conn, create_topic):
        options = writer_options({"kafka.bootstrap.servers": conn["bootstrap.servers"],
                                  "guarantee": "exactly_once", "write_id": "bench"})

        def settings(linger: int) -> dict[str, Any]:
            return {**options.producer_settings(f"cpu-{uuid.uuid4().hex[:8]}"), "linger.ms": linger}

        def topic() -> str:
            name = f"cpu-{uuid.uuid4().hex[:8]}"
            create_topic(name, 4)
            return name

        one_run(settings(lingers[0]), topic(), rows)  # unmeasured: cold brokers
        for r in range(rounds):
            for linger in round_order(lingers, r):
                run = {"round": r, "linger_ms": linger, **one_run(settings(linger), topic(), rows)}
                print(json.dumps(run), file=sys.stderr, flush=True)
                out["runs"].append(run)
    return out


if __name__ == "__main__":
    argv = [int(a) for a in sys.argv[1:]]
    print(json.dumps(main(argv[0] if argv else 250_000, argv[1] if len(argv) > 1 else 3, argv[2:] or [20]),
                     indent=2))
