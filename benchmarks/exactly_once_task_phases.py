"""Where one exactly_once Spark task's time goes: the writer's task code (`_ExactlyOnce.run`) run in this
process on Arrow batches as Spark hands them over, each phase timed.

    python benchmarks/exactly_once_task_phases.py [ROWS] [ROUNDS] [VARIANT ...] > out.json

A VARIANT is `chunk=N,sticky=N,linger=N` (any of the three, the others at the writer's defaults): the
`chunkRows` option, the rows per Kafka partition block (writer.STICKY_ROWS) and `kafka.linger.ms`. A task
writes ROWS rows of 100 bytes (batches of 10,000 rows, Spark's Arrow default) to a fresh 4-partition topic
under a fresh write id, once per VARIANT per round, interleaved, the order reversed every other round,
after one unmeasured task. Timed per task: the driver's prepare_write() (not part of the task's time),
the producer's creation, init_transactions(), the marker read, the rows (fingerprint, produce() calls and
the waits for room), each commit (marker and commit_transaction()), and the whole; and the CPU per row of
the task's Python thread (librdkafka's threads end with the task's producer, before they can be read:
rdkafka_thread_cpu.py measures those). A 3-node local cluster; no Spark, so no Spark scheduling or JVM in
the figures: this is the task's own cost.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)
from rdkafka_thread_cpu import thread_cpu

from reliable_kafka.bench.common import round_order
from reliable_kafka.spark import writer as writer_module
from reliable_kafka.spark.options import writer_options

PIECE = 10_000  # spark.sql.execution.arrow.maxRecordsPerBatch's default


def batches(rows: int) -> Iterator[pa.RecordBatch]:
    for first in range(0, rows, PIECE):
        n = min(PIECE, rows - first)
        values = pa.array([b"%0100d" % i for i in range(first, first + n)], pa.binary())
        yield pa.RecordBatch.from_arrays([values], names=["value"])


class Phases:
    """Seconds spent in each wrapped call during one task."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def parse_variant(text: str) -> dict[str, int]:
    spec = {"chunk": 250_000, "sticky": writer_module.STICKY_ROWS, "linger": 20}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in spec:
            raise SystemExit(f"unknown variant setting {name!r} (chunk, sticky, linger)")
        spec[name] = int(value)
    return spec


def one_task(conn: dict[str, Any], topic: str, rows: int, variant: str) -> dict[str, Any]:
    spec = parse_variant(variant)
    options = writer_options({
        "kafka.bootstrap.servers": conn["bootstrap.servers"], "topic": topic, "guarantee": "exactly_once",
        "write_id": f"phases-{uuid.uuid4().hex[:8]}", "numPartitions": "4", "chunkRows": str(spec["chunk"]),
        "kafka.linger.ms": str(spec["linger"]),
    })
    phases = Phases()
    phases.wrap("driver_prepare", writer_module.prepare_write)(options)  # the marker topic, the plan
    task = writer_module._ExactlyOnce(options, 0, 0)
    original_producer = writer_module.Producer

    def producer(settings: dict[str, Any]) -> Any:
        made = phases.wrap("create_producer", original_producer)(settings)
        return _TimedProducer(made, phases)

    task._committed_marker = phases.wrap("marker_read", task._committed_marker)  # type: ignore[method-assign]
    task._commit = phases.wrap("commit", task._commit)  # type: ignore[method-assign]
    sticky = writer_module.STICKY_ROWS
    writer_module.Producer = producer  # type: ignore[misc, assignment]
    writer_module.STICKY_ROWS = spec["sticky"]
    try:
        cpu_before, start = thread_cpu(), time.perf_counter()
        result = task.run(batches(rows), None)
        total, cpu_after = time.perf_counter() - start, thread_cpu()
    finally:
        writer_module.Producer = original_producer  # type: ignore[misc]
        writer_module.STICKY_ROWS = sticky
    assert result.rows == rows and result.rows_written == rows, result
    out = {k: round(v, 3) for k, v in phases.seconds.items()}
    out["rows_and_rest"] = round(total - sum(v for k, v in phases.seconds.items() if k != "driver_prepare"), 3)
    cpu = {n: round((cpu_after[n] - cpu_before.get(n, 0.0)) / rows * 1e6, 2) for n in cpu_after}
    return {"variant": variant, **spec, "seconds": round(total, 3), "rows_per_s": round(rows / total),
            "phases_s": out, "commits": phases.calls.get("commit", 0),
            "cpu_us_per_row": {n: us for n, us in sorted(cpu.items(), key=lambda kv: -kv[1]) if us > 0},
            "cpu_us_per_row_total": round(sum(cpu.values()), 2)}


class _TimedProducer:
    """The task's producer with init_transactions() timed (everything else passes straight through)."""

    def __init__(self, producer: Any, phases: Phases) -> None:
        self._producer = producer
        self.init_transactions = phases.wrap("init_transactions", producer.init_transactions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)


def main(rows: int, rounds: int, variants: list[str]) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    with bench_cluster() as (_cluster, conn, create_topic):
        def topic() -> str:
            name = f"phases-{uuid.uuid4().hex[:8]}"
            create_topic(name, 4)
            return name

        one_task(conn, topic(), min(rows, 50_000), variants[0])  # unmeasured: cold brokers, marker topic
        for r in range(rounds):
            for variant in round_order(variants, r):
                run = one_task(conn, topic(), rows, variant)
                print(json.dumps({"round": r, **run}), file=sys.stderr, flush=True)
                runs[variant].append(run)
    return {
        "rows": rows, "rounds": rounds,
        "variants": {
            v: {"rows_per_s_median": statistics.median(x["rows_per_s"] for x in rs),
                     "rows_per_s_min": min(x["rows_per_s"] for x in rs),
                     "rows_per_s_max": max(x["rows_per_s"] for x in rs), "runs": rs}
            for v, rs in runs.items()
        },
    }


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 750_000,
                          int(sys.argv[2]) if len(sys.argv) > 2 else 3,
                          sys.argv[3:] or ["chunk=250000", "chunk=1000000"]), indent=2))
