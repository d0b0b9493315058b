"""What one synced commit of a few messages costs on this host, by how it is made durable: the question
being whether `fsync`'s blocking send() would gain from the accept journal (durability "process"'s
memory-mapped records) with an fdatasync() per commit in place of a SQLite transaction.

    python benchmarks/fsync_commit_cost.py [COMMITS] [ROUNDS] [MESSAGES_A_COMMIT] > out.json

One thread, no Kafka, nothing else running; each commit appends MESSAGES_A_COMMIT (default 13: what a
commit of the 16-thread `fsync` row of `producer-calls` carried) 100-byte messages, then:

* `outbox_fsync`: `Outbox(durability="fsync").append()` — the SQLite transaction send() commits today
  (WAL, synchronous=FULL);
* `journal_fdatasync`: the same outbox with the accept journal, a record a message, then `fdatasync()`
  of its segment (a preallocated file whose blocks are written for the first time);
* `overwrite_dsync`: the floor of a sync on this disk, a 4 KiB `O_DSYNC` write over blocks written
  before (no allocation, no metadata).

ROUNDS interleaved rounds; each variant's median µs a commit and the per-round figures.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from reliable_kafka.bench.common import round_order
from reliable_kafka.outbox import Outbox
from reliable_kafka.outbox.journal import segment_paths
from reliable_kafka.spool import NewMessage

VALUE = b"v" * 100


def _messages(k: int) -> list[NewMessage]:
    return [NewMessage(str(uuid.uuid4()), "t", VALUE, None, (), None) for _ in range(k)]


def outbox(directory: Path, commits: int, k: int, journal: bool) -> float:
    path = directory / f"o-{uuid.uuid4().hex[:6]}.db"
    box = Outbox(path, durability="fsync", journal=journal, max_messages=10_000_000)
    try:
        batches = [_messages(k) for _ in range(commits)]
        fd = -1
        start = time.perf_counter()
        for batch in batches:
            if journal:  # a record a message, as send()s gathered by one group commit would write them
                for m in batch:
                    box.append([m])
                if fd < 0:  # the segment exists after the first append
                    fd = os.open(segment_paths(path)[-1], os.O_RDWR)
                os.fdatasync(fd)
            else:
                box.append(batch)
        elapsed = time.perf_counter() - start
        if fd >= 0:
            os.close(fd)
        return elapsed / commits * 1e6
    finally:
        box.close()


def overwrite(directory: Path, commits: int) -> float:
    path = directory / "overwrite"
    block = 4096
    with open(path, "wb") as f:
        f.write(b"\1" * block * 1024)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDWR | os.O_DSYNC)
    try:
        data = b"x" * block
        start = time.perf_counter()
        for i in range(commits):
            os.pwrite(fd, data, (i % 1024) * block)
        return (time.perf_counter() - start) / commits * 1e6
    finally:
        os.close(fd)


def main(commits: int, rounds: int, k: int) -> dict[str, Any]:
    variants = {"outbox_fsync": lambda d: outbox(d, commits, k, False),
                "journal_fdatasync": lambda d: outbox(d, commits, k, True),
                "overwrite_dsync": lambda d: overwrite(d, commits)}
    runs: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="fsync-commit-", dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        for r in range(rounds):
            for name in round_order(list(variants), r):
                directory = Path(tmp) / f"{name}-{r}"
                directory.mkdir()
                runs[name].append(round(variants[name](directory), 1))
                print(name, r, runs[name][-1], file=sys.stderr, flush=True)
    return {"commits": commits, "rounds": rounds, "messages_a_commit": k,
            "variants": {v: {"us_a_commit": statistics.median(r), "min": min(r), "max": max(r), "runs": r}
                         for v, r in runs.items()}}


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:4]]
    print(json.dumps(main(*(a + [2000, 5, 13][len(a):])), indent=1))
