"""Rows of one bench on two versions of the code, interleaved on one cluster.

    python benchmarks/before_after.py BENCH MESSAGES ROUNDS OUT.json BEFORE_DIR VARIANT@VERSION ...

BEFORE_DIR holds the older `reliable_kafka` package (e.g. `git archive <commit> reliable_kafka | tar -x -C
BEFORE_DIR`); the newer one is this checkout. VERSION is `before` or `after`; a baseline is named with
the version it runs on (e.g. `raw_safe@after`). One unmeasured run of the first row, then ROUNDS rounds of
every row in the order given, each in a bench worker process of its own on a topic of its own.

    python benchmarks/before_after.py producer-calls 1000000 3 out.json /tmp/before \
        aio-raw-tasks-200@after aio-send-tasks-200-memory@before aio-send-tasks-200-memory@after
    python benchmarks/before_after.py producer 5000000 3 out.json /tmp/before \
        raw_safe@after process@before process@after
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


def main() -> None:
    bench, n, rounds, out, before = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    rows = [tuple(arg.split("@")) for arg in sys.argv[6:]]
    code = {"before": before, "after": HERE}
    if not rows or any(len(r) != 2 or r[1] not in code for r in rows):
        raise SystemExit("name each row VARIANT@before or VARIANT@after")
    with bench_cluster() as (_cluster, conn, create):
        load_before = os.getloadavg()

        def one(variant: str, version: str) -> dict[str, Any]:
            topic = f"bench-{uuid.uuid4().hex[:8]}"
            create(topic, 3)
            os.environ["PYTHONPATH"] = code[version]  # the worker process imports this version
            return run_variant(bench, variant, ["--topic", topic, "--messages", str(n)], conn)

        one(*rows[0])  # warm-up, not measured
        labels = [f"{variant}@{version}" for variant, version in rows]
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
        for r in range(rounds):
            for (variant, version), label in zip(rows, labels, strict=True):
                result = one(variant, version)
                runs[label].append(result)
                stall = result.get("loop_stall_max_ms")
                print(f"round {r + 1} {label}: {result['msgs_per_s']:,.0f} msgs/s"
                      + (f", worst loop stall {stall} ms" if stall is not None else ""), flush=True)
        for label in labels:
            print(f"{label}: median {statistics.median(x['msgs_per_s'] for x in runs[label]):,.0f} msgs/s")
        out.write_text(json.dumps({"bench": bench, "messages": n, "rounds": rounds, "load_before": load_before,
                                   "load_after": os.getloadavg(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
