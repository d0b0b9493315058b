"""Where the processor's time goes around its commits: the at-least-once copier and TransactionalProcessor
at several `linger.ms` and `max_batch_messages`, on one cluster, interleaved.

    python benchmarks/eos_commit_probe.py [--out PATH] MESSAGES ROUNDS

A transaction's records are invisible until its commit, and `commit_transaction()` sends whatever still
lingers, so the processor's producer lingers as long as a transaction stays open by default (its batch
interval, 100 ms): its broker threads no longer spin on batches waiting for the request in flight. But
the commit then sends the whole transaction, and while a commit is in flight the loop fills a backlog of
at most `max_batch_messages` and then waits. Each processor copy reports, besides its rate (as `bench
eos` clocks it), the share of its wall time the loop spent waiting for a commit, the mean time of a
commit and of its two calls (send_offsets_to_transaction, then commit_transaction), and the records a
commit carried. Each copy in a process of its own, one unmeasured copy of up to 200,000 records each
first. Written to PATH (default benchmarks/results/eos/commit-probe.json).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _cluster import eos_copies, out_path, seeded_eos_cluster  # benchmarks/_cluster.py (run from this directory)

from reliable_kafka.bench import eos
from reliable_kafka.bench.common import peak_rss_mb, run_child
from reliable_kafka.testing.child_connection import connection_from_env
from reliable_kafka.transactions import checkpoint as checkpoint_module

OUT = Path(__file__).resolve().parent / "results" / "eos" / "commit-probe.json"
# variant: (linger.ms, max_batch_messages); None: the processor's default
VARIANTS: dict[str, tuple[int | None, int | None]] = {
    "processor-batch-20k": (None, 20_000),
    "processor-batch-50k": (None, 50_000),
    "processor-batch-100k": (None, 100_000),
}


def child(source: str, output: str, n: int, linger_ms: int | None, max_batch: int | None) -> None:
    """One processor copy (bench eos's copy and clock, eos.copy_rate) with its waits and commits timed."""
    waited = [0.0]
    commits: list[float] = []
    calls: dict[str, float] = {}
    call = checkpoint_module.call
    result_unless_hung = checkpoint_module.Checkpoint._result_unless_hung
    end_transaction = checkpoint_module.Checkpoint._end_transaction

    def timed_call(operation: str, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(operation, *args, **kwargs)
        finally:
            calls[operation] = calls.get(operation, 0.0) + time.perf_counter() - started

    def timed_wait(self: Any, future: Any) -> Any:
        started = time.perf_counter()
        try:
            return result_unless_hung(self, future)
        finally:
            waited[0] += time.perf_counter() - started

    def timed_commit(self: Any, *args: Any) -> Any:
        started = time.perf_counter()
        try:
            return end_transaction(self, *args)
        finally:
            commits.append(time.perf_counter() - started)

    checkpoint_module.call = timed_call  # type: ignore[assignment]
    checkpoint_module.Checkpoint._result_unless_hung = timed_wait  # type: ignore[method-assign]
    checkpoint_module.Checkpoint._end_transaction = timed_commit  # type: ignore[method-assign]
    options: dict[str, Any] = {}
    if linger_ms is not None:
        options["producer_overrides"] = {"linger.ms": linger_ms}
    if max_batch is not None:
        options["max_batch_messages"] = max_batch
    started = time.perf_counter()
    rate = eos.copy_rate(eos.VARIANT, connection_from_env(), source, output, n, options)
    wall = time.perf_counter() - started
    print(json.dumps({"msgs_per_s": rate, "loop_waiting": waited[0] / wall,
                      "commit_ms": statistics.mean(commits) * 1000, "records_per_commit": n / len(commits),
                      "peak_rss_mb": peak_rss_mb(),
                      "call_ms": {op: took / len(commits) * 1000 for op, took in calls.items()}}))


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        linger, batch = (None if a == "default" else int(a) for a in argv[4:6])
        child(argv[1], argv[2], int(argv[3]), linger, batch)
        return
    path, argv = out_path(argv, OUT)
    n, rounds = int(argv[0]), int(argv[1])
    runs: dict[str, list[dict[str, Any]]] = {eos.BASELINE: [], **{v: [] for v in VARIANTS}}
    with seeded_eos_cluster("eos-commit", n) as (conn, create, source):
        for measured, variant, output, copy in eos_copies(create, "eos-commit", runs, n, rounds):
            if variant in VARIANTS:
                argv_child = [sys.executable, __file__, "--child", source, output, str(copy),
                              *("default" if a is None else str(a) for a in VARIANTS[variant])]
                result = run_child(argv_child, conn, variant)
            else:
                result = eos._in_own_process(variant, conn, source, output, copy)
            if measured:
                runs[variant].append(result)
                print(f"{variant}: {json.dumps(result)}", flush=True)
    base = [r["msgs_per_s"] for r in runs[eos.BASELINE]]
    for variant, results in runs.items():
        rates = [r["msgs_per_s"] for r in results]
        ratios = ", ".join(f"{rate / b:.2f}" for rate, b in zip(rates, base, strict=True))
        extra = ""
        if variant in VARIANTS:
            waits = ", ".join(f"{r['loop_waiting']:.0%}" for r in results)
            commits = ", ".join(f"{r['commit_ms']:.0f}" for r in results)
            per_commit = statistics.median(r["records_per_commit"] for r in results)
            extra = f"; loop waiting {waits}; commit {commits} ms; {per_commit:,.0f} records a commit"
        print(f"{variant}: median {statistics.median(rates):,.0f} records/s, ratio per round {ratios}{extra}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"messages": n, "rounds": rounds, "variants": VARIANTS, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
