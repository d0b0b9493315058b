"""What every benchmark shares: the row shape of `reliable-kafka bench --json`, the targets, and
running one variant in its own process so its peak RSS and its CPU are its own.

Speed claims are ratios against a baseline measured in the same run on the same brokers, never
absolute numbers from a timed test.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

# (benchmark, variant) -> the ratio vs its baseline that DESIGN.md §6 asks for.
TARGETS: dict[tuple[str, str], float] = {
    ("producer", "memory"): 0.95,
    ("producer", "process"): 0.7,
    ("producer", "fsync"): 0.5,
    ("consumer", "reliable_consumer"): 0.9,
    ("eos", "transactional_processor"): 0.85,
    ("dedup", "sqlite"): 0.8,
    ("dedup", "redis"): 0.7,
    ("spark", "at_least_once"): 1.0,
    ("spark", "exactly_once"): 0.8,
}


@dataclass(frozen=True)
class BenchRow:
    name: str
    variant: str
    messages: int
    msgs_per_s: float
    baseline: str
    ratio_vs_baseline: float
    peak_rss_mb: float

    def as_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["msgs_per_s"] = round(self.msgs_per_s, 1)
        d["ratio_vs_baseline"] = round(self.ratio_vs_baseline, 3)
        d["peak_rss_mb"] = round(self.peak_rss_mb, 1)
        return d


def peak_rss_mb() -> float:
    """This process's peak resident set size (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_variant(bench: str, variant: str, args: Sequence[str], timeout: float = 1800) -> dict[str, Any]:
    """Run `python -m reliable_kafka.bench.worker BENCH VARIANT ARGS` and return its JSON result."""
    proc = subprocess.run(
        [sys.executable, "-m", "reliable_kafka.bench.worker", bench, variant, *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark {bench}/{variant} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def rows_against(name: str, baseline: str, results: dict[str, dict[str, Any]], messages: int) -> list[BenchRow]:
    """Turn {variant: {"msgs_per_s", "peak_rss_mb"}} into rows with ratios against `baseline`."""
    base = results[baseline]["msgs_per_s"]
    return [
        BenchRow(name, variant, messages, r["msgs_per_s"], baseline, r["msgs_per_s"] / base if base else 0.0,
                 r["peak_rss_mb"])
        for variant, r in results.items()
    ]
