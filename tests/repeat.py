"""Run the real-part tiers of the suite N times in a row and print each test's pass count.

`./dev test --repeat N [PYTEST ARGS]` runs this. A guarantee test that passes 4 times in 5 is a flake,
and a flake is a defect: this is how one is found before CI finds it. Each run writes a JUnit XML
report; the table at the end counts, per test, how many runs it passed, failed, errored or skipped.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


def outcomes(report: Path) -> dict[str, str]:
    """test id -> outcome, from one JUnit XML report."""
    out: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        out[test_id] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                        else "skipped" if "skipped" in kinds else "passed")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, required=True, help="how many runs in a row")
    ap.add_argument("--marker", default="cluster or spark or redis",
                    help="which tests (a pytest -m expression); default: every real-part tier")
    ap.add_argument("--reports", type=Path, default=None, help="where the JUnit reports go (default: a temp dir)")
    args, pytest_args = ap.parse_known_args(argv)
    if args.repeat < 1:
        ap.error("--repeat takes a whole number of runs, 1 or more")
    reports = args.reports or Path(tempfile.mkdtemp(prefix="rk-repeat-"))
    reports.mkdir(parents=True, exist_ok=True)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(OUTCOMES, 0))
    summary = []
    for run in range(1, args.repeat + 1):
        report = reports / f"run-{run}.xml"
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "pytest", "-n", "2",
                                "-p", "no:cacheprovider", "-q", "-m", args.marker, f"--junitxml={report}",
                                *pytest_args])
        seconds = time.monotonic() - started
        got = outcomes(report) if report.exists() else {}
        for test_id, outcome in got.items():
            counts[test_id][outcome] += 1
        failed = sorted(t for t, o in got.items() if o in ("failed", "error"))
        summary.append((run, code, seconds, len(got), failed))
        print(f"repeat: run {run} of {args.repeat}: exit {code}, {len(got)} tests, {len(failed)} failed, "
              f"{seconds:.0f} s", file=sys.stderr, flush=True)
    print(f"\nper-test results over {args.repeat} run(s) (reports in {reports}):")
    width = max((len(t) for t in counts), default=10)
    flaky = 0
    for test_id in sorted(counts, key=lambda t: (counts[t]["passed"], t)):
        c = counts[test_id]
        mark = "" if c["failed"] + c["error"] == 0 else "  <- FAILED"
        flaky += bool(mark)
        print(f"  {test_id:<{width}}  {c['passed']}/{args.repeat} passed"
              + "".join(f", {c[o]} {o}" for o in ("failed", "error", "skipped") if c[o]) + mark)
    for run, code, seconds, n, failed in summary:
        failures = f"; failed: {', '.join(failed)}" if failed else ""
        print(f"run {run}: exit {code}, {n} tests in {seconds:.0f} s{failures}")
    print(f"{len(counts) - flaky} tests passed every run, {flaky} failed at least once")
    return 1 if flaky or any(code != 0 for _, code, *_ in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
