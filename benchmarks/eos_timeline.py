"""What changes as an exactly-once copy runs on: each eos variant's rate and CPU per record, window by window.

    python benchmarks/eos_timeline.py [--out PATH] MESSAGES > out.txt

One 3-node cluster; MESSAGES records with rk-ids are seeded once; then the at-least-once copier and
TransactionalProcessor (100 ms commits) each copy them in a process of their own, as `bench eos` runs
them. Every 2 s a variant's process notes how many records its commits covered so far, its threads' CPU
(Python threads and librdkafka's own, from /proc) and the CPU its garbage collector took; the windows
show whether a variant slows down, or its baseline speeds up, as the run grows. Written to PATH
(default benchmarks/results/eos/timeline.json), one list of windows per variant.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from _cluster import eos_script_args, seeded_eos_cluster  # benchmarks/_cluster.py (scripts run from this directory)
from _threads import TICK, read_threads

from reliable_kafka.bench import eos
from reliable_kafka.bench.common import run_child
from reliable_kafka.testing.child_connection import connection_from_env

OUT = Path(__file__).resolve().parent / "results" / "eos" / "timeline.json"
WINDOW_S = 2.0


def _thread_cpu(seen: dict[str, tuple[str, int]]) -> collections.Counter[str]:
    """CPU ticks so far of this process's threads, librdkafka's (named rdk:*) apart from the rest."""
    read_threads(seen)
    total: collections.Counter[str] = collections.Counter()
    for name, ticks in seen.values():
        total["librdkafka" if name.startswith("rdk:") else "python"] += ticks
    return total


def child(variant: str, source: str, output: str, n: int) -> None:
    """One variant's copy, watched: prints {"rate", "windows"} as JSON."""
    copied = [0]
    gc_cpu = [0.0, 0.0]  # total, start of the collection in progress (CPU of the collecting thread)

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            gc_cpu[1] = time.thread_time()
        else:
            gc_cpu[0] += time.thread_time() - gc_cpu[1]

    gc.callbacks.append(on_gc)
    for cls in (eos.AtLeastOnceCopier, eos.TransactionalProcessor):
        _count_commits(cls, copied)
    samples: list[tuple[float, int, int, int, float]] = []
    stop = threading.Event()

    def sample() -> None:
        seen: dict[str, tuple[str, int]] = {}
        t0 = time.perf_counter()
        while not stop.is_set():
            cpu = _thread_cpu(seen)
            samples.append((time.perf_counter() - t0, copied[0], cpu["python"], cpu["librdkafka"], gc_cpu[0]))
            stop.wait(WINDOW_S)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    rate = eos.copy_rate(variant, connection_from_env(), source, output, n)
    stop.set()
    watcher.join()
    windows = []
    for (t0, n0, py0, rdk0, gc0), (t1, n1, py1, rdk1, gc1) in zip(samples, samples[1:], strict=False):
        if n1 > n0:
            per = 1e6 / (n1 - n0)
            windows.append({"t_s": round(t1, 1), "copied": n1, "rate": round((n1 - n0) / (t1 - t0)),
                            "python_us": round((py1 - py0) / TICK * per, 2),
                            "librdkafka_us": round((rdk1 - rdk0) / TICK * per, 2),
                            "gc_us": round((gc1 - gc0) * per, 2)})
    print(json.dumps({"rate": rate, "windows": windows}), flush=True)
    os._exit(0)  # a lingering librdkafka thread must not keep the run waiting


def _count_commits(cls: Any, copied: list[int]) -> None:
    """Have every instance of `cls` add each commit's records to copied[0] before its own on_commit."""
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        theirs = kwargs.get("on_commit")

        def on_commit(info: Any) -> None:
            copied[0] += info.messages
            if theirs is not None:
                theirs(info)

        kwargs["on_commit"] = on_commit
        init(self, *args, **kwargs)

    cls.__init__ = __init__


def main() -> None:
    asked = eos_script_args(sys.argv[1:], child, OUT)
    if asked is None:
        return  # this process was one child copy
    path, argv = asked
    n = int(argv[0])
    result: dict[str, Any] = {"messages": n, "window_s": WINDOW_S, "variants": {}}
    with seeded_eos_cluster("eos-timeline", n) as (conn, create, source):
        for variant in (eos.VARIANT, eos.BASELINE):
            output = f"eos-timeline-out-{uuid.uuid4().hex[:6]}"
            create(output, eos.PARTITIONS)
            run = run_child([sys.executable, __file__, "--child", variant, source, output, str(n)], conn, variant)
            result["variants"][variant] = run
            print(f"{variant}: {run['rate']:,.0f} records/s", flush=True)
            for w in run["windows"]:
                print(f"  {w['t_s']:6.1f} s {w['copied']:>9,} copied {w['rate']:>8,}/s  python {w['python_us']:5.2f} us"
                      f"  librdkafka {w['librdkafka_us']:5.2f} us  gc {w['gc_us']:4.2f} us", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
