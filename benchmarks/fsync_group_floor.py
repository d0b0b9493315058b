"""The floor of a blocking send() per message in durability "fsync": threads that each wait until a sync
covers their message, with nothing else running (no Kafka, no brokers, no SQLite, no message at all).

    python benchmarks/fsync_group_floor.py [--out PATH] MESSAGES ROUNDS > out.txt

Each thread calls `GroupCommit.submit()` in a loop, the group commit `send()` uses in "fsync"
(reliable_kafka/producer/group_commit.py: leader/follower, each waiting caller asleep on a lock of its
own, the first caller back after a commit waiting for the others), with an accept() that writes 512
bytes into a preallocated file and `fdatasync()`s it (the GIL released) in place of the outbox's
transaction and the produce() calls. Rows: 1 and 16 threads, with no sync (the wake-ups alone) and with
one; and 16 threads split among 2 and 4 files, each file with a group commit of its own (an outbox
sharded by thread: do syncs of separate files overlap?). ROUNDS interleaved rounds; each row's median
msgs/s and the process's CPU a message (user, system). JSON to PATH (default
benchmarks/results/journal/fsync-group-floor.json).

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _cluster import out_path  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.producer.group_commit import GroupCommit
from reliable_kafka.spool import NewMessage

OUT = Path(__file__).resolve().parent / "results" / "journal" / "fsync-group-floor.json"
RECORD = b"x" * 512


class SyncAccept:
    """GroupCommit's accept(): each commit one 512-byte write into the file, and with `sync` its fdatasync()."""

    def __init__(self, fd: int, sync: bool) -> None:
        self._fd, self._sync = fd, sync
        self._seq = 0
        self.commits = 0

    def __call__(self, rows: Sequence[NewMessage], errors: dict[int, str]) -> list[int]:
        os.pwrite(self._fd, RECORD, 0)
        if self._sync:
            os.fdatasync(self._fd)  # releases the GIL, as SQLite's commit does
        self.commits += 1
        first, self._seq = self._seq + 1, self._seq + len(rows)
        return list(range(first, self._seq + 1))


def run(n: int, threads: int, sync: bool, files: int = 1) -> dict[str, Any]:
    """`files` > 1: as many files, each with a GroupCommit of its own, the threads split evenly among them
    (what an outbox sharded by sending thread would do)."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        fds = [os.open(os.path.join(d, f"floor-{i}.bin"), os.O_RDWR | os.O_CREAT, 0o644) for i in range(files)]
        try:
            accepts = []
            for fd in fds:
                os.posix_fallocate(fd, 0, 1 << 20)
                accepts.append(SyncAccept(fd, sync))
            groups = [GroupCommit(accept) for accept in accepts]
            share = n // threads
            row = NewMessage("id", "topic", b"x" * 100)

            def body(group: GroupCommit) -> None:
                submit = group.submit
                for _ in range(share):
                    submit(row)

            senders = [threading.Thread(target=body, args=(groups[i % files],)) for i in range(threads)]
            cpu, start = os.times(), time.perf_counter()
            for t in senders:
                t.start()
            for t in senders:
                t.join()
            took, cpu_after = time.perf_counter() - start, os.times()
        finally:
            for fd in fds:
                os.close(fd)
    sent = share * threads
    return {"msgs_per_s": sent / took, "per_commit": sent / sum(a.commits for a in accepts),
            "user_us": (cpu_after.user - cpu.user) / sent * 1e6,
            "system_us": (cpu_after.system - cpu.system) / sent * 1e6}


ROWS = {  # name: (threads, sync, files)
    "wake-ups-1": (1, False, 1),
    "wake-ups-16": (16, False, 1),
    "fdatasync-1": (1, True, 1),
    "fdatasync-16": (16, True, 1),
    # Syncs of different files run side by side: does the disk take two (four) at once in the time of one?
    "fdatasync-16-2-files": (16, True, 2),
    "fdatasync-16-4-files": (16, True, 4),
}


def main() -> None:
    out, argv = out_path(sys.argv[1:], OUT)
    n, rounds = int(argv[0]), int(argv[1])
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    for r in range(rounds):
        for name, (threads, sync, files) in ROWS.items():
            got = run(n if sync else n * 5, threads, sync, files)
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
