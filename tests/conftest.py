"""Shared test set-up: the real-part fixtures, and how the suite is spread over two pytest-xdist workers.

`./dev test` runs two workers. Each worker that runs a cluster test starts its own 3-node cluster (a
session fixture), so at most two clusters run at once (plus the doctor's weak one while its module runs).
How tests are handed out is decided here, by `Scheduling` below, not by xdist's `xdist_group` markers:
with pytest 9.2, pytest-xdist 3.8 adds the group to a node id pytest no longer reads, so every marked
test was handed out on its own and the groups this file once declared never held.

- The Spark tests are one unit: one worker runs all of them in one Spark session (two would need a
  second JVM of about a gigabyte and its start-up, on a machine with two cores).
- A module whose fixture is module-scoped and costly (a second cluster, a built wheel) is one unit, so
  its fixture is built once, not on each worker that gets one of its tests.
- Every other test is a unit of its own, handed to whichever worker is free: the workers finish within
  a few seconds of each other, which fixed groups of modules never did (their sizes drift with every
  new test).
- Longest first: the slow fault scenarios are collected before everything else and the unit tests last,
  so no long test starts when the other worker is almost done.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest_plugins = [
    "tests.fixtures.kafka",
    "tests.fixtures.redis",
    "tests.fixtures.members",
]

# Modules with a costly module-scoped fixture: run whole on one worker (tests/unit/test_suite_layout.py checks
# that every module with such a fixture is listed here).
WHOLE_MODULES = frozenset({
    "tests/integration/test_doctor.py",     # a second cluster with weak settings
    "tests/integration/test_telemetry.py",  # the OpenTelemetry SDK set up once per module
    "tests/unit/test_wheel_install.py",     # a wheel built once
})


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: every test in one unit runs on the same worker, in order."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/spark/"):
        return "tests/spark"
    if path in WHOLE_MODULES:
        return path
    return nodeid


def _rank(item: pytest.Item) -> int:
    if item.get_closest_marker("slow") is not None:
        return 0
    path = item.nodeid.split("::", 1)[0]
    return 2 if path.startswith("tests/unit/") else 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: the same order on every worker (xdist refuses to run when the workers' collections differ).
    items.sort(key=_rank)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        """LoadScopeScheduling with our units as its scopes (xdist hands out larger scopes first)."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return Scheduling(config, log)
