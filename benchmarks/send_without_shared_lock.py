"""How fast one send() per message from 16 threads could be if it took no shared lock: a bound, not a producer.

    python benchmarks/send_without_shared_lock.py [--fsync [--zeroed]] [--out PATH] MESSAGES ROUNDS > out.txt

`send()` in durability `process` holds the dispatcher's ordering lock (and inside it the outbox's) while it
journals the message and hands it to librdkafka. produce() never gives up the GIL, but once one sender
waits on the lock every release wakes a sleeping one: a context switch per message from 16 threads
(0.6-0.8 per message, against 0.03 from one thread, at any switch interval). This script measures the
same work without any lock shared between senders, the ceiling of a send path built that way:

* each thread journals into an AcceptJournal of its own (the outbox's record format, one record a message);
* the seq comes from itertools.count (one C call: atomic under the GIL);
* produce() on the sender's thread, with a per-message partial as the delivery callback (as the
  dispatcher's) and the rk-id header;
* a poller thread serves delivery reports and journals each round's delivered seqs, as the outbox does.

What it leaves out, and a real path would need: the outbox's bookkeeping (pending counts, its bound, the
settle into SQLite), the hand-over order the dispatcher keeps for its backlog and rebuilds, tracing, and
the preflight. So its figure is an upper bound of the design. Against it, in the same run on the same
3-node cluster, interleaved: raw confluent-kafka from 16 threads (the producer-calls baseline) and
ReliableProducer.send() from 16 threads. Every run is written to PATH (default
benchmarks/results/journal/send-without-shared-lock.json).

With --fsync it is the bound of durability "fsync" built the same way, one sync lane per thread: each
sender `fdatasync()`s its own journal file after its record (the GIL released, the other senders going
on), so no sender waits for another's commit or is woken by another thread; against it, send() from 16
threads in "fsync" (the group commit). Why it might pay: this host's disk serves concurrent syncs of
different files in parallel (6,254 syncs/s from one file, 33,548 from 16 files at once, a pwrite and
an fdatasync per sync: benchmarks/parallel_fdatasync.py), where the group commit serializes them. Left
out besides the above: syncing the directory when a segment is created (once per 16 MiB). Each sender
creates its lane before the clock starts. With --zeroed as well, a lane's file is written with zeros and
synced then, instead of preallocated (posix_fallocate leaves unwritten extents, so the first store into
each block is a metadata change that a sync must commit through ext4's journal, together with whatever
else is dirty on the filesystem, the brokers' logs included). Default PATH:
benchmarks/results/journal/fsync-lanes-bound.json (fsync-lanes-zeroed-bound.json with --zeroed).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)
from confluent_kafka import Producer

from reliable_kafka.bench.calls import VALUE, shares
from reliable_kafka.bench.common import run_child, run_variant
from reliable_kafka.config import producer_config
from reliable_kafka.ids import ID_HEADER, new_id
from reliable_kafka.outbox.journal import AcceptJournal
from reliable_kafka.spool import NewMessage

OUT = Path(__file__).resolve().parent / "results" / "journal" / "send-without-shared-lock.json"
FSYNC = "--fsync" in sys.argv[1:]
ZEROED = "--zeroed" in sys.argv[1:]
CALL_VARIANTS = ("raw-threads-16", "send-threads-16-fsync" if FSYNC else "send-threads-16-process")
BOUND = ("fsync-lanes-zeroed-16" if ZEROED else "fsync-lanes-16") if FSYNC else "no-shared-lock-16"
if FSYNC:
    OUT = OUT.with_name("fsync-lanes-zeroed-bound.json" if ZEROED else "fsync-lanes-bound.json")


def _zero_fill(fd: int, offset: int, size: int) -> None:
    """posix_fallocate's stand-in under --zeroed: the blocks written (as zeros) and synced, not reserved."""
    chunk = bytes(1 << 20)
    for at in range(offset, offset + size, len(chunk)):
        os.pwrite(fd, chunk[:min(len(chunk), offset + size - at)], at)
    os.fsync(fd)


if ZEROED:
    os.posix_fallocate = _zero_fill
THREADS = 16


def no_shared_lock(connection: dict[str, Any], topic: str, n: int, threads: int) -> dict[str, Any]:
    """The bound's run in this process: msgs/s from the first send to the last delivery report, and CPU."""
    folder = Path(tempfile.mkdtemp(prefix="rk-bound-"))
    p = Producer(producer_config(connection))
    seqs = itertools.count(1)
    local = threading.local()
    delivered: list[int] = []
    all_back, stop = threading.Event(), threading.Event()

    def report(seq: int, err: Any, _msg: Any) -> None:
        if err is None:
            delivered.append(seq)

    acks = AcceptJournal(folder / "acks.db")

    def poller() -> None:
        total = 0
        while not stop.is_set():
            p.poll(0.05)
            if delivered:
                batch = delivered[:]
                del delivered[:len(batch)]
                acks.delivered(batch)
                total += len(batch)
                if total >= n:
                    all_back.set()

    def send(value: bytes) -> None:
        journal = getattr(local, "journal", None)
        if journal is None:
            journal = local.journal = AcceptJournal(folder / f"thread-{threading.get_ident()}.db")
        seq = next(seqs)
        message_id = new_id()
        journal.append(seq, (NewMessage(message_id, topic, value, None, (), None),), time.time_ns() // 1_000_000)
        if FSYNC:
            os.fdatasync(journal._segments[-1].fd)  # this thread's lane: its file holds only its records
        while True:
            try:
                p.produce(topic, value, None, -1, functools.partial(report, seq), None, 0,
                          [(ID_HEADER, message_id.encode())])
                return
            except BufferError:
                p.poll(0.01)

    go = threading.Event()

    def body(count: int) -> None:
        if FSYNC:  # the lane and its first segment before the clock starts
            local.journal = AcceptJournal(folder / f"thread-{threading.get_ident()}.db")
            local.journal._new_segment(0)
        go.wait()
        for _ in range(count):
            send(VALUE)

    senders = [threading.Thread(target=body, args=(c,), daemon=True) for c in shares(n, threads)]
    for t in senders:
        t.start()
    poll_thread = threading.Thread(target=poller, daemon=True)
    poll_thread.start()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    go.set()
    for t in senders:
        t.join()
    if not all_back.wait(300):
        raise RuntimeError("the bound's messages were not all delivered within 300 s")
    took = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    stop.set()
    poll_thread.join(5)
    return {"msgs_per_s": n / took, "seconds": took,
            "cpu_us_per_msg": ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)) / n * 1e6,
            "context_switches_per_msg": ((after.ru_nvcsw - before.ru_nvcsw) + (after.ru_nivcsw - before.ru_nivcsw)) / n}


def _bound_in_child(connection: dict[str, Any], topic: str, n: int) -> dict[str, Any]:
    """The bound in a process of its own, as the bench's variants run (its CPU is its own)."""
    flag = (["--fsync"] if FSYNC else []) + (["--zeroed"] if ZEROED else [])
    return run_child([sys.executable, __file__, *flag, "--child", topic, str(n)], connection, "the bound")


def main() -> None:
    argv = [a for a in sys.argv[1:] if a not in ("--fsync", "--zeroed")]
    if argv[:1] == ["--child"]:
        from reliable_kafka.testing.child_connection import connection_from_env

        print(json.dumps(no_shared_lock(connection_from_env(), argv[1], int(argv[2]), THREADS)), flush=True)
        return
    out_path = OUT
    if argv[:1] == ["--out"]:
        out_path, argv = Path(argv[1]), argv[2:]
    n, rounds = int(argv[0]), int(argv[1])
    with bench_cluster() as (_cluster, conn, create):

        def fresh_topic() -> str:
            topic = f"bound-{uuid.uuid4().hex[:8]}"
            create(topic, 3)
            return topic

        run_variant("producer-calls", CALL_VARIANTS[0], ["--topic", fresh_topic(), "--messages", str(n)], conn)
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in (*CALL_VARIANTS, BOUND)}
        for r in range(rounds):
            for v in runs:
                out = (_bound_in_child(conn, fresh_topic(), n) if v == BOUND else
                       run_variant("producer-calls", v, ["--topic", fresh_topic(), "--messages", str(n)], conn))
                runs[v].append(out)
                print(f"round {r + 1} {v}: {out['msgs_per_s']:,.0f} msgs/s", flush=True)
        base = [x["msgs_per_s"] for x in runs[CALL_VARIANTS[0]]]
        for v, results in runs.items():
            rates = [x["msgs_per_s"] for x in results]
            ratios = [a / b for a, b in zip(rates, base, strict=True)]
            print(f"{v}: median {statistics.median(rates):,.0f} msgs/s [{min(rates):,.0f}-{max(rates):,.0f}], "
                  f"ratio to raw {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"messages": n, "rounds": rounds, "threads": THREADS, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
