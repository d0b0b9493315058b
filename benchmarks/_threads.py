"""The CPU of this process's threads, from /proc: what the benchmark scripts that split a process's CPU by
thread read."""

from __future__ import annotations

import os

TICK = os.sysconf("SC_CLK_TCK")  # /proc's CPU times are in these per second


def read_threads(seen: dict[str, tuple[str, int]]) -> None:
    """Record in `seen` each live thread's name and CPU ticks so far (user + system), by thread id; a thread
    that ended keeps its last reading there. librdkafka names its threads rdk:*."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended: its last reading stays counted
        seen[tid] = (name, int(fields[11]) + int(fields[12]))
