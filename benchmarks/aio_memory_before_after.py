"""The asyncio `memory` row on two versions of the code, interleaved with AIOProducer on one cluster.

    python benchmarks/aio_memory_before_after.py MESSAGES ROUNDS OUT.json BEFORE_DIR

BEFORE_DIR holds the older `reliable_kafka` package (e.g. `git archive <commit> reliable_kafka | tar -x -C
BEFORE_DIR`); the newer one is this checkout. One unmeasured AIOProducer run, then ROUNDS rounds of:
AIOProducer, ours before, ours after, each in a bench worker process of its own on a topic of its own.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.bench.common import run_variant

HERE = str(Path(__file__).resolve().parent.parent)
ROWS = (("aio-raw-tasks-200", "after", "aio-raw-tasks-200"),
        ("aio-send-tasks-200-memory", "before", "memory-before"),
        ("aio-send-tasks-200-memory", "after", "memory-after"))


def main() -> None:
    n, rounds, out, before = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    code = {"before": before, "after": HERE}
    with bench_cluster() as (_cluster, conn, create):
        load_before = os.getloadavg()

        def one(variant: str, version: str) -> dict[str, Any]:
            topic = f"calls-{uuid.uuid4().hex[:8]}"
            create(topic, 3)
            os.environ["PYTHONPATH"] = code[version]  # the worker process imports this version
            return run_variant("producer-calls", variant, ["--topic", topic, "--messages", str(n)], conn)

        one("aio-raw-tasks-200", "after")  # warm-up, not measured
        runs: dict[str, list[dict[str, Any]]] = {label: [] for _, _, label in ROWS}
        for r in range(rounds):
            for variant, version, label in ROWS:
                result = one(variant, version)
                runs[label].append(result)
                print(f"round {r + 1} {label}: {result['msgs_per_s']:,.0f} msgs/s, "
                      f"worst loop stall {result.get('loop_stall_max_ms')} ms", flush=True)
        for _, _, label in ROWS:
            print(f"{label}: median {statistics.median(x['msgs_per_s'] for x in runs[label]):,.0f} msgs/s")
        out.write_text(json.dumps({"messages": n, "rounds": rounds, "load_before": load_before,
                                   "load_after": os.getloadavg(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
