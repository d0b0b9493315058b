"""Where the CPU of one send() per message goes: raw `produce()` from 16 threads against
`ReliableProducer.send()` from 16 threads (durability "process"), thread by thread, on a 3-node cluster.

    python benchmarks/producer_thread_cpu.py [MESSAGES] [ROUNDS] [THREADS] > out.json

Both variants run in this process through the bench's own functions (reliable_kafka.bench.calls, the
`raw-threads-16` and `send-threads-16-process` rows of `bench producer-calls`), so that their threads
can be measured. Per message: the senders' CPU (each sender thread's thread_time() when it ends), the
CPU of the thread that serves delivery reports (the raw poller or ours), the whole process's (librdkafka's
threads included) and the three brokers' (from /proc); and librdkafka's produce requests per 1,000
messages (its statistics: `tx` summed over the brokers, the last report of the run). One unmeasured raw
run, then ROUNDS rounds, the order reversed every other round. Prints one JSON document: every run and
the median of each figure per variant.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.bench import calls
from reliable_kafka.bench.common import round_order

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads, ended ones included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@contextmanager
def _threads_cpu_at_end() -> Iterator[list[tuple[str, float]]]:
    """(name, CPU seconds) of every Python thread that ends inside the block: the bench's sender threads
    and report pollers end before its function returns, when /proc no longer lists them."""
    ended: list[tuple[str, float]] = []
    run = threading.Thread.run

    def measured(self: threading.Thread) -> None:
        try:
            run(self)
        finally:
            ended.append((self.name, time.thread_time()))

    threading.Thread.run = measured  # type: ignore[method-assign]
    try:
        yield ended
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]


def _one(variant: str, conn: dict[str, Any], create: Callable[..., Any], brokers: list[int], n: int,
         threads: int) -> dict[str, Any]:
    topic = f"cpu-{uuid.uuid4().hex[:8]}"
    create(topic, 3)
    last: dict[str, int] = {}

    def on_stats(report: str) -> None:
        last["tx"] = sum(b.get("tx", 0) for b in json.loads(report)["brokers"].values())

    settings = {**conn, "statistics.interval.ms": 250, "stats_cb": on_stats}
    brokers_before, process_before = sum(map(_cpu_s, brokers)), _cpu_s(os.getpid())
    with _threads_cpu_at_end() as ended:
        if variant == "raw":
            took, _ = calls._raw_threads(settings, topic, n, threads)
        else:
            took, _ = calls._reliable_threads(settings, topic, n, threads, "process")
    per = 1e6 / n
    senders = sum(cpu for name, cpu in ended if name.endswith("(body)"))  # calls._start_threads' targets
    reports = sum(cpu for name, cpu in ended if name.endswith("(serve_reports)") or name == "reliable-kafka-producer")
    return {
        "variant": variant,
        "msgs_per_s": round(n / took),
        "us_per_message": {
            "senders": round(senders * per, 2),
            "report_thread": round(reports * per, 2),
            "process": round((_cpu_s(os.getpid()) - process_before) * per, 2),
            "brokers": round((sum(map(_cpu_s, brokers)) - brokers_before) * per, 2),
        },
        "produce_requests_per_1000": round(last.get("tx", 0) / n * 1000, 2),
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    variants = ["raw", "ours"]
    with bench_cluster() as (cluster, conn, create):
        brokers = [node.proc.pid for node in cluster.nodes.values() if node.proc is not None]
        _one("raw", conn, create, brokers, n, threads)  # warm-up, not measured
        runs: list[dict[str, Any]] = []
        for r in range(rounds):
            for variant in round_order(variants, r):
                runs.append(_one(variant, conn, create, brokers, n, threads))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    medians = {}
    for variant in variants:
        mine = [run for run in runs if run["variant"] == variant]
        medians[variant] = {
            "msgs_per_s": statistics.median(run["msgs_per_s"] for run in mine),
            "produce_requests_per_1000": statistics.median(run["produce_requests_per_1000"] for run in mine),
            **{k: statistics.median(run["us_per_message"][k] for run in mine) for k in mine[0]["us_per_message"]},
        }
    print(json.dumps({"messages": n, "rounds": rounds, "threads": threads, "load_after": os.getloadavg(),
                      "median": medians, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
