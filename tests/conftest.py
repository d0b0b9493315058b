"""Shared test set-up: the real-part fixtures, and how the suite is spread over pytest-xdist workers.

`./dev test` runs three workers. The first two run everything; each that runs a cluster test starts its
own 3-node cluster (a session fixture), so at most two clusters run at once (plus the doctor's weak one
while its module runs). The third is a helper: while cluster or Spark tests are left to hand out it takes
only the unit tests that wait on librdkafka's timers with little CPU (LIGHT_WAITS), then any unit-tier
test. While the clusters run, the two cores are busy and a third worker running CPU-bound tests would only
starve the brokers; in the tail (the unit tier, much of it waiting on timeouts and child processes) the
cores were 20-75 % busy with two workers.
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
    "tests/integration/test_secured_cluster.py",  # a one-node SASL/ACL cluster
    "tests/integration/test_cli_secured.py",  # a one-node SASL cluster for the CLI
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
        """LoadScopeScheduling with our units as its scopes (xdist hands out larger scopes first), and
        workers beyond the first CLUSTER_WORKERS held back until only unit-tier units are left."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if is_tail_helper(node.gateway.id) and not only_unit_tier(self.workqueue):
                # While clusters run, a helper takes only tests that wait on timers with little CPU; with
                # none left it is woken by _reschedule() of another worker once only unit tests are left.
                early = next((unit for unit in self.workqueue if is_light_wait(unit)), None)
                if early is None:
                    return
                self.workqueue.move_to_end(early, last=False)  # the unit super() pops next
            super()._assign_work_unit(node)

        def _reschedule(self, node: Any) -> None:
            super()._reschedule(node)
            # A test ended on `node`: a helper that was held back may take work now, or stop.
            for helper in self.nodes:
                if helper is node or helper.shutting_down or not is_tail_helper(helper.gateway.id):
                    continue
                if not self.workqueue:
                    helper.shutdown()
                elif self._pending_of(self.assigned_work[helper]) <= 2:
                    self._assign_work_unit(helper)

    return Scheduling(config, log)


CLUSTER_WORKERS = 2  # workers that may run cluster and Spark tests; any further one is a tail helper


def is_tail_helper(worker_id: str) -> bool:
    """gw0 and gw1 run everything; gw2 and up only the unit tier's tail."""
    return int(worker_id.removeprefix("gw")) >= CLUSTER_WORKERS


# Unit-tier tests marked `waits` whose seconds go to librdkafka's timers against its in-process mock cluster or
# against no broker at all, with little CPU: the tail helper runs them from the start, beside the cluster
# tests, instead of leaving them to the two cluster workers. (Not every `waits` test: test_service_crash's
# uvicorn workers would take CPU from the brokers.) tests/unit/test_suite_layout.py checks that each is marked.
LIGHT_WAITS = (
    "tests/unit/test_transactions_mock.py::",
    "tests/unit/test_producer_errors.py::",
    "tests/unit/test_authorization_holds.py::",
    "tests/unit/test_mock_cluster.py::",
    "tests/unit/test_spark_writer_fenced.py::test_a_fenced_task_whose_produce_says_fatal_error_raises_transaction_fenced",
    "tests/unit/test_spark_marker_release.py::test_release_tombstones_a_completed_write_and_a_stale_attempt_of_it_is_refused",
    "tests/unit/test_cli.py::test_doctor_on_unreachable_brokers_fails_clearly",
    "tests/unit/test_cli_connection.py::test_doctor_on_unreachable_brokers_with_a_login_never_prints_the_password",
)


def is_light_wait(unit: str) -> bool:
    """Whether a unit is one of LIGHT_WAITS (a whole module's tests, or one test with its parameters)."""
    return unit.startswith(LIGHT_WAITS)


def only_unit_tier(units: Any) -> bool:
    """Whether every unit still to hand out is a unit-tier one (none needs a cluster or Spark)."""
    return all(unit.startswith("tests/unit/") for unit in units)


class _WorkerTimeline:
    """Per worker: how long it ran tests and when it ran out of them. The suite's wall time is the last
    worker's end; a worker that ends long before it is a core the scheduling left idle (printed at the
    end of every distributed run, so each CI log says where the suite's minutes went)."""

    def __init__(self) -> None:
        self.busy: dict[str, float] = {}
        self.tests: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def add(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)
        if node is None:
            return  # not a distributed run
        worker = node.gateway.id
        self.busy[worker] = self.busy.get(worker, 0.0) + report.duration
        if report.when == "call":
            self.tests[worker] = self.tests.get(worker, 0) + 1
        self.first[worker] = min(self.first.get(worker, report.start), report.start)
        self.last[worker] = max(self.last.get(worker, report.stop), report.stop)

    def lines(self) -> list[str]:
        if not self.busy:
            return []
        start = min(self.first.values())
        end = max(self.last.values())
        return [
            f"{w}: {self.tests.get(w, 0)} tests, {self.busy[w]:.0f} s in tests, from {self.first[w] - start:.0f} s "
            f"to {self.last[w] - start:.0f} s (idle for the last {end - self.last[w]:.0f} s)"
            for w in sorted(self.busy)
        ]


_timeline = _WorkerTimeline()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _timeline.add(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines = _timeline.lines()
    if lines:
        terminalreporter.section("workers")
        for line in lines:
            terminalreporter.write_line(line)
