"""Rows of one bench on two versions of the code, interleaved on one cluster.

    python benchmarks/before_after.py BENCH MESSAGES ROUNDS OUT.json BEFORE_DIR VARIANT@VERSION ...

BEFORE_DIR holds the older `reliable_kafka` package (e.g. `git archive <commit> reliable_kafka | tar -x -C
BEFORE_DIR`); the newer one is this checkout. VERSION is `before` or `after`; a baseline is named with
the version it runs on (e.g. `raw_safe@after`). One unmeasured run of the first row, then ROUNDS rounds of
every row in the order given, each in a bench worker process of its own on a topic of its own.

BENCH `eos` copies one input seeded with MESSAGES records (as `bench eos` does), each row's copy in a
process of its own into a topic of its own, after one unmeasured copy of up to 200,000 records by every
row; each run also records its process's CPU per record (user + system, all its threads).

    python benchmarks/before_after.py producer-calls 1000000 3 out.json /tmp/before \
        aio-raw-tasks-200@after aio-send-tasks-200-memory@before aio-send-tasks-200-memory@after
    python benchmarks/before_after.py producer 5000000 3 out.json /tmp/before \
        raw_safe@after process@before process@after
    python benchmarks/before_after.py eos 2000000 3 out.json /tmp/before \
        at_least_once_copier@after transactional_processor@before transactional_processor@after
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

from _cluster import bench_cluster, seed_eos_input  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.bench import eos
from reliable_kafka.bench.common import run_variant

HERE = str(Path(__file__).resolve().parent.parent)


def main() -> None:
    bench, n, rounds, out, before = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    code = {"before": before, "after": HERE}
    rows = [(variant, version) for variant, _, version in (arg.partition("@") for arg in sys.argv[6:])]
    if not rows or any(version not in code for _, version in rows):
        raise SystemExit("name each row VARIANT@before or VARIANT@after")
    with bench_cluster() as (_cluster, conn, create):
        load_before = os.getloadavg()
        source = seed_eos_input(conn, create, "bench-eos", n) if bench == "eos" else ""

        def one(variant: str, version: str, messages: int = n) -> dict[str, Any]:
            topic = f"bench-{uuid.uuid4().hex[:8]}"
            create(topic, 3)
            os.environ["PYTHONPATH"] = code[version]  # the worker process imports this version
            if bench != "eos":
                return run_variant(bench, variant, ["--topic", topic, "--messages", str(messages)], conn)
            used = resource.getrusage(resource.RUSAGE_CHILDREN)
            result = eos._in_own_process(variant, conn, source, topic, messages)
            now = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_s = now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime
            return {**result, "cpu_us_per_record": round(cpu_s / messages * 1e6, 3)}

        if bench == "eos":
            for row in dict.fromkeys(rows):  # every row's first copy warms the brokers' transactional paths
                one(*row, messages=min(n, eos.WARM_UP_RECORDS))
        else:
            one(*rows[0])  # warm-up, not measured
        labels = [f"{variant}@{version}" for variant, version in rows]
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
        for r in range(rounds):
            for (variant, version), label in zip(rows, labels, strict=True):
                result = one(variant, version)
                runs[label].append(result)
                stall, cpu = result.get("loop_stall_max_ms"), result.get("cpu_us_per_record")
                print(f"round {r + 1} {label}: {result['msgs_per_s']:,.0f} msgs/s"
                      + (f", worst loop stall {stall} ms" if stall is not None else "")
                      + (f", {cpu} us of CPU a record" if cpu is not None else ""), flush=True)
        for label in labels:
            print(f"{label}: median {statistics.median(x['msgs_per_s'] for x in runs[label]):,.0f} msgs/s")
        out.write_text(json.dumps({"bench": bench, "messages": n, "rounds": rounds, "load_before": load_before,
                                   "load_after": os.getloadavg(), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
