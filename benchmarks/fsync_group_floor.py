"""The floor of a blocking send() per message in durability "fsync": threads that each wait until a sync
covers their message, with nothing else running (no Kafka, no brokers, no SQLite, no message at all).

    python benchmarks/fsync_group_floor.py [--out PATH] MESSAGES ROUNDS > out.txt

Each sender queues a ticket and sleeps on a lock of its own; a caller that finds no commit in progress
leads: it writes 512 bytes into a preallocated file and `fdatasync()`s it (the GIL released), then wakes
the callers that commit covered and hands leadership to the oldest one still queued. This is the group
commit's mechanism (reliable_kafka/producer/group_commit.py) stripped to its system calls, with and
without its gather (the first caller back after a commit waits, at most as long as that commit took, for
the others that commit returned to). Rows: 1 and 16 threads, with no sync (the wake-ups alone) and with
one. ROUNDS interleaved rounds; each row's median msgs/s and the process's CPU a message (user, system).
JSON to PATH (default benchmarks/results/journal/fsync-group-floor.json).

What it is for: from threads that each block until their own message is durable, throughput is at most
the threads in flight over the time a commit cycle takes (Little's law); this measures that bound on the
host the benchmarks run on, so the `producer-calls` fsync row can be read against it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from _cluster import out_path  # benchmarks/_cluster.py (scripts run from this directory)

OUT = Path(__file__).resolve().parent / "results" / "journal" / "fsync-group-floor.json"
RECORD = b"x" * 512


class Ticket:
    __slots__ = ("gate", "done")

    def __init__(self) -> None:
        self.gate = threading.Lock()
        self.gate.acquire()  # released when a commit covered it or its caller is to lead
        self.done = False


class Floor:
    """Leader/follower group commit over one file: `submit()` returns once a commit covered its call."""

    def __init__(self, fd: int, sync: bool, gather: bool) -> None:
        self._fd, self._sync, self._gather = fd, sync, gather
        self._lock = threading.Lock()
        self._gathered = threading.Condition(self._lock)
        self._queue: deque[Ticket] = deque()
        self._leading = False
        self._expected = 0  # callers the last commit returned to, not yet back
        self._until = 0.0  # how long after that commit a caller waits for them
        self._last_s = 0.0
        self._gathering = False
        self.commits = 0

    def _commit(self) -> None:
        started = time.monotonic()
        os.pwrite(self._fd, RECORD, 0)
        if self._sync:
            os.fdatasync(self._fd)
        self.commits += 1
        self._last_s = time.monotonic() - started

    def submit(self) -> None:
        lock = self._lock
        lock.acquire()
        if self._expected:
            self._expected -= 1
            if not self._expected and self._gathering:
                self._gathered.notify()
        gather = False
        if not self._leading and not self._queue:
            if not (self._gather and self._expected and time.monotonic() < self._until):
                self._leading = True
                lock.release()
                self._commit()
                self._hand_on([], callers=1)
                return
            gather = True
        ticket = Ticket()
        self._queue.append(ticket)
        waiting, self._leading = self._leading, True
        if gather:
            self._gathering = True
            while self._expected and (left := self._until - time.monotonic()) > 0:
                self._gathered.wait(left)
            self._gathering, self._expected = False, 0
        lock.release()
        if waiting:
            ticket.gate.acquire()
        while not ticket.done:
            with lock:
                batch = list(self._queue)
                self._queue.clear()
            self._commit()
            self._hand_on(batch)
            if not ticket.done:
                ticket.gate.acquire()

    def _hand_on(self, batch: list[Ticket], callers: int = 0) -> None:
        with self._lock:
            for t in batch:
                t.done = True
            self._expected = callers + len(batch)
            self._until = time.monotonic() + self._last_s
            head = self._queue[0] if self._queue else None
            if head is None:
                self._leading = False
        for t in batch:
            t.gate.release()
        if head is not None:
            head.gate.release()  # its caller leads the next commit


def run(n: int, threads: int, sync: bool, gather: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        fd = os.open(os.path.join(d, "floor.bin"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(fd, 0, 1 << 20)
            floor = Floor(fd, sync, gather)
            share = n // threads

            def body() -> None:
                for _ in range(share):
                    floor.submit()

            senders = [threading.Thread(target=body) for _ in range(threads)]
            cpu, start = os.times(), time.perf_counter()
            for t in senders:
                t.start()
            for t in senders:
                t.join()
            took, cpu_after = time.perf_counter() - start, os.times()
        finally:
            os.close(fd)
    sent = share * threads
    return {"msgs_per_s": sent / took, "per_commit": sent / floor.commits,
            "user_us": (cpu_after.user - cpu.user) / sent * 1e6,
            "system_us": (cpu_after.system - cpu.system) / sent * 1e6}


ROWS = {  # name: (threads, sync, gather)
    "wake-ups-1": (1, False, False),
    "wake-ups-16": (16, False, False),
    "fdatasync-1": (1, True, False),
    "fdatasync-16": (16, True, False),
    "fdatasync-16-gather": (16, True, True),
}


def main() -> None:
    out, argv = out_path(sys.argv[1:], OUT)
    n, rounds = int(argv[0]), int(argv[1])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    for r in range(rounds):
        for name, (threads, sync, gather) in ROWS.items():
            got = run(n if sync else n * 5, threads, sync, gather)
            runs[name].append(got)
            print(f"round {r + 1} {name}: {got['msgs_per_s']:,.0f} msgs/s, {got['per_commit']:.1f} a commit, "
                  f"CPU {got['user_us']:.1f} + {got['system_us']:.1f} µs a message", flush=True)
    for name, figures in runs.items():
        rates = [f["msgs_per_s"] for f in figures]
        print(f"{name}: median {statistics.median(rates):,.0f} msgs/s [{min(rates):,.0f}–{max(rates):,.0f}]")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"messages": n, "rounds": rounds, "cores": os.cpu_count(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
