"""Where the time of the asyncio `memory` rows goes: each variant's CPU by thread, and the brokers' CPU.

    python benchmarks/aio_memory_cpu.py MESSAGES VARIANT [VARIANT ...] > out.txt

Each variant of `reliable_kafka/bench/calls.py` runs in this process (the first once more as an unmeasured
warm-up) on a 3-node local cluster; for each it prints msgs/s, the process's CPU per message split by
thread (librdkafka's threads by their own names), and the three brokers' CPU per message over the run.
`aio-send-tasks-200-memory+writer` is that variant with Dispatcher.accept_now() declining every batch,
so that every send goes through the writer thread, as before the sends of a loop pass were accepted on
the loop.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.bench import calls
from reliable_kafka.producer.dispatcher import Dispatcher

TICK = os.sysconf("SC_CLK_TCK")
ACCEPT_NOW = Dispatcher.accept_now


def cpu_s(stat_path: str) -> float:
    """User + system CPU seconds of a process or thread, from its /proc stat file."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class ThreadCpu:
    """Samples every thread's CPU of this process (a thread's last figure is kept after it ended)."""

    def __init__(self) -> None:
        self.cpu: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for t in threading.enumerate():
            if t.native_id is not None:
                self.names[t.native_id] = t.name
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                c = cpu_s(f"/proc/self/task/{tid}/stat")
                if tid not in self.names:
                    with open(f"/proc/self/task/{tid}/comm") as f:
                        self.names[tid] = f.read().strip()
            except OSError:
                continue  # it ended meanwhile
            self.cpu[tid] = max(self.cpu.get(tid, 0.0), c)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.sample()

    def __enter__(self) -> ThreadCpu:
        self.sample()
        self.start = dict(self.cpu)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def by_name(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for tid, c in self.cpu.items():
            name = self.names.get(tid, "?")
            if name.startswith("rdk:broker"):
                name = "rdk:broker*"
            elif name.startswith(("ThreadPoolExecutor", "asyncio_")):
                name = "executor threads"
            out[name] = out.get(name, 0.0) + c - self.start.get(tid, 0.0)
        return out


def main() -> None:
    n, variants = int(sys.argv[1]), sys.argv[2:]
    with bench_cluster() as (cluster, conn, create):
        brokers = [node.proc.pid for node in cluster.nodes.values() if node.proc is not None]
        for i, name in enumerate([variants[0], *variants]):
            topic = f"cpu-{uuid.uuid4().hex[:8]}"
            create(topic, 3)
            Dispatcher.accept_now = (  # type: ignore[method-assign]
                (lambda self, rows, errors: None) if name.endswith("+writer") else ACCEPT_NOW)
            brokers_before = sum(cpu_s(f"/proc/{p}/stat") for p in brokers)
            cpu_before = time.process_time()
            with ThreadCpu() as threads:
                took, facts = calls.run(calls.BY_NAME[name.split("+")[0]], conn, topic, n)
            cpu = time.process_time() - cpu_before
            broker_cpu = sum(cpu_s(f"/proc/{p}/stat") for p in brokers) - brokers_before
            print(f"{'warm-up ' if i == 0 else ''}{name}: {n / took:,.0f} msgs/s, {facts}", flush=True)
            print(f"  this process {cpu / n * 1e6:.1f} us/msg, brokers {broker_cpu / n * 1e6:.1f} us/msg")
            for thread, c in sorted(threads.by_name().items(), key=lambda kv: -kv[1]):
                if c > 0.05:
                    print(f"  {thread:32s} {c / n * 1e6:6.1f} us/msg", flush=True)


if __name__ == "__main__":
    main()
