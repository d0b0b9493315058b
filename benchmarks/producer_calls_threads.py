"""The threaded rows of `reliable-kafka bench producer-calls`, alone: raw `produce()` and `send()` from 16
threads and from one, on a 3-node local cluster, each variant run by the bench's own worker process.

    python benchmarks/producer_calls_threads.py [--out PATH] MESSAGES ROUNDS [VARIANT ...] > out.txt

One unmeasured warm-up run, then ROUNDS interleaved rounds (the order reversed every other round); each
run's figures and the medians are printed, and every run is written to PATH (default
benchmarks/results/journal/producer-calls-threads.json). Other rows of the suite run the same way when named
(e.g. aio-raw-tasks-200 aio-send-tasks-200-memory). The full `bench producer-calls` (8 variants, 1M each, 3
rounds) takes over 40 minutes on a 2-core host.
"""

from __future__ import annotations

import json
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.bench.common import round_order, run_variant

VARIANTS = ("raw-threads-16", "send-threads-16-process", "raw-threads-1", "send-threads-1-process")
OUT = Path(__file__).resolve().parent / "results" / "journal" / "producer-calls-threads.json"


def main() -> None:
    argv = sys.argv[1:]
    out_path = OUT
    if argv[:1] == ["--out"]:
        out_path, argv = Path(argv[1]), argv[2:]
    n, rounds = int(argv[0]), int(argv[1])
    variants = tuple(argv[2:]) or VARIANTS
    with bench_cluster() as (cluster, conn, create):

        def args() -> list[str]:
            topic = f"calls-{uuid.uuid4().hex[:8]}"
            create(topic, 3)
            return ["--topic", topic, "--messages", str(n)]

        run_variant("producer-calls", variants[0], args(), conn)  # warm-up, not measured
        runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for r in range(rounds):
            for v in round_order(variants, r):
                out = run_variant("producer-calls", v, args(), conn)
                runs[v].append(out)
                print(f"round {r + 1} {v}: {out['msgs_per_s']:,.0f} msgs/s", flush=True)
        for v in variants:
            print(f"{v}: median {statistics.median(x['msgs_per_s'] for x in runs[v]):,.0f} msgs/s")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps({"messages": n, "rounds": rounds, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
