"""Where each eos variant's CPU goes over a whole copy: its threads, its collector, its producer's broker threads.

    python benchmarks/eos_cpu.py [--out PATH] MESSAGES ROUNDS

One 3-node cluster; MESSAGES records with rk-ids are seeded once; then, after one unmeasured copy of up to
200,000 records each, the at-least-once copier and TransactionalProcessor (100 ms commits) take turns
copying them (the processor twice: with the copy Transform and with a MapValues), ROUNDS times, each copy in
a process of its own, as `bench eos` runs them. Per copy and per record: the CPU of the thread that runs the
loop, of the other Python threads (the processor's commit thread) and of librdkafka's threads (their total
and the busiest one's), the time the garbage collector took and its collections per generation, the share of
consume() calls made while a commit was in flight, and, from the producer's statistics, each broker thread's
wake-ups and produce requests: a broker thread that wakes millions of times for a few hundred requests is
spinning. Written to PATH (default benchmarks/results/eos/cpu.json).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import confluent_kafka
from _cluster import eos_copies, eos_script_args, seeded_eos_cluster  # benchmarks/_cluster.py (run from this directory)
from _threads import TICK, read_threads

from reliable_kafka.bench import eos
from reliable_kafka.bench.common import run_child
from reliable_kafka.lab import eos_copier_bounce
from reliable_kafka.testing.child_connection import connection_from_env
from reliable_kafka.transactions import checkpoint, processor

OUT = Path(__file__).resolve().parent / "results" / "eos" / "cpu.json"


class _WatchedConsumer(confluent_kafka.Consumer):
    """Counts consume() calls, and those made while the processor's commit was in flight (it then waits
    checkpoint.COMMIT_CHECK_S at most, and only then)."""

    calls = 0
    during_commit = 0

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[confluent_kafka.Message]:
        _WatchedConsumer.calls += 1
        if timeout == checkpoint.COMMIT_CHECK_S:
            _WatchedConsumer.during_commit += 1
        return super().consume(num_messages=num_messages, timeout=timeout)


def child(variant: str, source: str, output: str, n: int) -> None:
    """One variant's copy: prints its breakdown as JSON."""
    collections = [[0, 0.0] for _ in range(3)]  # per generation: count, CPU of the collecting thread
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            entry = collections[info["generation"]]
            entry[0] += 1
            entry[1] += time.thread_time() - started[0]

    stats: dict[str, Any] = {}

    def on_stats(report: str) -> None:
        stats.update(json.loads(report))

    gc.callbacks.append(on_gc)
    processor.Consumer = _WatchedConsumer  # type: ignore[misc]  # both variants' consumers, watched alike
    eos_copier_bounce.Consumer = _WatchedConsumer  # type: ignore[misc]
    with_stats = {"statistics.interval.ms": 500, "stats_cb": on_stats}
    producer_class = eos_copier_bounce.Producer
    eos_copier_bounce.Producer = lambda conf: producer_class({**conf, **with_stats})  # type: ignore[assignment,misc]
    processor_class = eos.TransactionalProcessor
    eos.TransactionalProcessor = lambda *a, **kw: processor_class(  # type: ignore[assignment,misc]
        *a, **kw, producer_overrides=with_stats)
    seen: dict[str, tuple[str, int]] = {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            read_threads(seen)

    watcher = threading.Thread(target=sample, name="watcher", daemon=True)
    watcher.start()
    loop_cpu = time.thread_time()
    rate = eos.copy_rate(variant, connection_from_env(), source, output, n)
    loop_cpu = time.thread_time() - loop_cpu
    stop.set()
    watcher.join()
    read_threads(seen)
    per = 1e6 / n
    rdk = [ticks / TICK * per for name, ticks in seen.values() if name.startswith("rdk:")]
    others = sum(ticks for name, ticks in seen.values() if not name.startswith("rdk:") and name != "watcher")
    print(json.dumps({
        "rate": rate,
        "loop_thread_us": round(loop_cpu * per, 2),
        "other_python_threads_us": round(others / TICK * per - loop_cpu * per, 2),
        "librdkafka_us": round(sum(rdk), 2),
        "busiest_librdkafka_thread_us": round(max(rdk, default=0.0), 2),
        "gc_us": round(sum(c[1] for c in collections) * per, 3),
        "gc_collections": [c[0] for c in collections],
        "consume_calls": _WatchedConsumer.calls,
        "consume_calls_during_commit": _WatchedConsumer.during_commit,
        "producer_brokers": {
            b["name"]: {"wakeups": b.get("wakeups", 0), "produce_requests": b.get("req", {}).get("Produce", 0)}
            for b in stats.get("brokers", {}).values() if b.get("req", {}).get("Produce")
        },
    }), flush=True)
    os._exit(0)  # a lingering librdkafka thread must not keep the run waiting


def main() -> None:
    asked = eos_script_args(sys.argv[1:], child, OUT)
    if asked is None:
        return  # this process was one child copy
    path, argv = asked
    n, rounds = int(argv[0]), int(argv[1])
    results: dict[str, list[dict[str, Any]]] = {eos.BASELINE: [], eos.VARIANT: [], eos.MAP_VALUES: []}
    with seeded_eos_cluster("eos-cpu", n) as (conn, create, source):
        for measured, variant, output, copy in eos_copies(create, "eos-cpu", results, n, rounds):
            argv_child = [sys.executable, __file__, "--child", variant, source, output, str(copy)]
            result = run_child(argv_child, conn, f"eos cpu {variant}")
            if measured:
                results[variant].append(result)
                print(variant, json.dumps(result), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"messages": n, "rounds": rounds, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
