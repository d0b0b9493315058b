"""What every benchmark shares: the row shape of `reliable-kafka bench --json`, the targets, and
running one variant in its own process so its peak RSS and its CPU are its own.

Speed claims are ratios against a baseline measured in the same run on the same brokers, never
absolute numbers from a timed test.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from reliable_kafka.testing.child_connection import Connection, child_env

# (benchmark, variant) -> the ratio vs its baseline that DESIGN.md §6 asks for.
TARGETS: dict[tuple[str, str], float] = {
    ("producer", "memory"): 0.95,
    ("producer", "process"): 0.8,
    ("producer", "fsync"): 0.6,
    # One send() per message from many threads / asyncio tasks (bench/calls.py), each against raw
    # confluent-kafka driven the same way.
    ("producer-calls", "send-threads-16-process"): 0.7,
    ("producer-calls", "send-threads-16-fsync"): 0.5,
    ("producer-calls", "aio-send-tasks-200-process"): 0.7,
    ("producer-calls", "aio-send-tasks-200-memory"): 1.0,
    ("consumer", "reliable_consumer"): 0.9,
    # Against confluent-kafka's aio.AIOConsumer in a loop with manual commits, same async handler.
    ("consumer", "aio_reliable"): 0.9,
    ("eos", "transactional_processor"): 0.85,
    ("eos", "transactional_processor_map_values"): 0.85,
    # Against the idempotent consumer written by hand on the same store (TARGET_BASELINES).
    ("dedup", "sqlite"): 0.8,
    ("dedup", "redis"): 0.8,
    # Against Spark's own sink with the batching our writer uses (TARGET_BASELINES).
    ("spark", "at_least_once"): 1.0,
    ("spark", "exactly_once"): 0.5,
    # Structured Streaming Kafka -> Kafka, against Spark's own source + sink with the same batching.
    ("spark-stream", "at_least_once"): 1.0,
    ("spark-stream", "exactly_once"): 0.5,
}


# A variant measured against more than one baseline meets its target against this one, the like-for-like one;
# its rows against the others are for reference (dedup: the rows against ReliableConsumer without dedup).
TARGET_BASELINES: dict[tuple[str, str], str] = {
    # Against the producer a careful user hand-writes: an rk-id header and a callback per message (raw_safe).
    ("producer", "memory"): "raw_safe",
    ("producer", "process"): "raw_safe",
    ("producer", "fsync"): "raw_safe",
    ("dedup", "sqlite"): "handwritten_sqlite",
    ("dedup", "redis"): "handwritten_redis",
    ("spark", "at_least_once"): "spark_kafka_sink_batched",
    ("spark", "exactly_once"): "spark_kafka_sink_batched",
}


# A run shorter than this measures start-up and scheduling more than throughput: its ratio is noise.
SHORT_RUN_S = 5.0


# Keys of a row's JSON computed from its fields (as_json writes them, from_json recomputes them).
_DERIVED = frozenset({"shortest_run_s"})


@dataclass(frozen=True)
class BenchRow:
    """One variant's result: the median of its interleaved runs, their spread, and every run's figure.

    `ratio_vs_baseline` is the median of the per-round ratios (each run against the baseline's run of
    the same round), so a slow minute of the brokers that hit one round does not decide the ratio.
    """

    name: str
    variant: str
    messages: int
    msgs_per_s: float
    baseline: str
    ratio_vs_baseline: float
    peak_rss_mb: float
    runs: tuple[float, ...] = ()  # msgs/s of every run, in round order
    ratio_min: float | None = None
    ratio_max: float | None = None
    # What only some benchmarks report (e.g. producer-calls: every round's ratio, commits, loop stalls):
    # written as keys of the row's JSON beside the others, and absent from rows that have none.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shortest_run_s(self) -> float:
        fastest = max(self.runs) if self.runs else self.msgs_per_s
        return self.messages / fastest if fastest else 0.0

    @property
    def short(self) -> bool:
        """Its fastest run lasted under SHORT_RUN_S: more messages are needed for a ratio to mean much."""
        return self.shortest_run_s < SHORT_RUN_S

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        d["msgs_per_s"] = round(self.msgs_per_s, 1)
        d["ratio_vs_baseline"] = round(self.ratio_vs_baseline, 3)
        d["peak_rss_mb"] = round(self.peak_rss_mb, 1)
        d["runs"] = [round(r, 1) for r in self.runs]
        for k in ("ratio_min", "ratio_max"):
            d[k] = None if d[k] is None else round(d[k], 3)
        d["shortest_run_s"] = round(self.shortest_run_s, 2)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BenchRow:
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["runs"] = tuple(known.get("runs", ()))
        known["extra"] = {k: v for k, v in d.items() if k not in cls.__dataclass_fields__ and k not in _DERIVED}
        return cls(**known)


def target_of(row: BenchRow) -> float | None:
    """The ratio the row's variant must reach against the row's baseline (DESIGN.md §6), or None: no target."""
    key = (row.name, row.variant)
    if TARGET_BASELINES.get(key, row.baseline) != row.baseline:
        return None
    return TARGETS.get(key)


def peak_rss_mb() -> float:
    """This process's peak resident set size, in MB.

    From /proc/self/status (VmHWM) where there is one: Linux carries a parent's ru_maxrss over exec() into
    its child, so a measured child of a bench process that had seeded 5M records (~560 MB) reported that
    figure, whatever it used itself. getrusage() elsewhere (kilobytes on Linux, bytes on macOS).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


@contextmanager
def sampled_peak_rss_mb() -> Iterator[list[float]]:
    """Peak resident memory of this process and its children (Spark's JVM, its Python workers), sampled
    every 0.25 s while the block runs: for variants that run in this process (the Spark suites)."""
    import psutil

    peak = [0.0]
    stop = threading.Event()
    me = psutil.Process()

    def sample() -> None:
        while not stop.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    continue
            peak[0] = max(peak[0], total / 1e6)
            stop.wait(0.25)

    thread = threading.Thread(target=sample, name="rk-bench-rss", daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


def run_variant(bench: str, variant: str, args: Sequence[str], connection: Connection,
                timeout: float = 1800) -> dict[str, Any]:
    """Run `python -m reliable_kafka.bench.worker BENCH VARIANT ARGS` and return its JSON result.

    `connection` reaches the variant in its environment, never on its command line (testing.child_connection).
    """
    return run_child([sys.executable, "-m", "reliable_kafka.bench.worker", bench, variant, *args], connection,
                     f"benchmark {bench}/{variant}", timeout)


def run_child(argv: Sequence[str], connection: Connection, what: str, timeout: float = 1800) -> dict[str, Any]:
    """Run one measured process and return the last JSON object it printed: each variant runs alone, so
    that its CPU time and peak RSS are its own. `connection` reaches it in its environment only.

    RuntimeError naming `what` when it exits non-zero or prints no JSON (the end of its stderr attached).
    """
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=child_env(connection),
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


_V = TypeVar("_V")


def round_order(variants: Sequence[_V], round_no: int) -> list[_V]:
    """The order the variants run in round `round_no` (0-based): as given in even rounds, reversed in odd
    ones (A B C, C B A, A B C, ...).

    Why: in a fixed order each variant always follows the same neighbour and holds the same place in the
    round, so whatever the one before leaves the brokers (replication and log flushes still running, a
    warmer page cache) lands on the same variant every round. Alternating gives each variant the first and
    the last place alike over pairs of rounds; the per-round ratios still compare runs of the same round.
    """
    return list(variants) if round_no % 2 == 0 else list(variants)[::-1]


def rows_against(name: str, baseline: str, runs: dict[str, list[dict[str, Any]]], messages: int) -> list[BenchRow]:
    """Rows from {variant: [run, ...]} (each run {"msgs_per_s", "peak_rss_mb"}, round i of every variant
    measured back to back): each variant's median, its spread, and the median of its per-round ratios."""
    base_runs = [r["msgs_per_s"] for r in runs[baseline]]
    rows = []
    for variant, results in runs.items():
        rates = [r["msgs_per_s"] for r in results]
        ratios = [rate / base for rate, base in zip(rates, base_runs, strict=False) if base]
        rows.append(BenchRow(
            name, variant, messages, statistics.median(rates), baseline,
            statistics.median(ratios) if ratios else 0.0, max(r["peak_rss_mb"] for r in results),
            tuple(rates), min(ratios) if ratios else None, max(ratios) if ratios else None,
        ))
    return rows


def loop_stalls(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A row's `extra` for the worst event-loop stall of each asyncio run (its `loop_stall_max_ms`) and over
    them all; empty for runs that report none."""
    if not results or "loop_stall_max_ms" not in results[0]:
        return {}
    each = [r["loop_stall_max_ms"] for r in results]
    return {"loop_stall_runs_ms": each, "loop_stall_max_ms": max(each)}


def run_facts(*, messages: int, repeat: int, nodes: int, load_before: tuple[float, float, float],
              local_cluster: bool) -> dict[str, Any]:
    """What a reader needs to judge a run's figures: the host, its load before and after, versions."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import confluent_kafka

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    from reliable_kafka.testing.jars import KAFKA_VERSION

    return {
        "messages": messages,
        "rounds": repeat,
        "round_order": "the listed order in rounds 1, 3, 5, ..., reversed in rounds 2, 4, ...",
        "cluster_nodes": nodes,
        "host": {"cores": os.cpu_count(), "load_before": [round(x, 2) for x in load_before],
                 "load_after": [round(x, 2) for x in os.getloadavg()]},
        "versions": {"reliable_kafka": installed("reliable-kafka"), "confluent_kafka": installed("confluent-kafka"),
                     "librdkafka": confluent_kafka.libversion()[0], "python": platform.python_version(),
                     # The brokers' version is known for the cluster the bench started; not for one it was given.
                     "kafka": KAFKA_VERSION if local_cluster else None, "pyspark": installed("pyspark")},
    }
