"""How the suite is spread over the xdist workers (tests/conftest.py): the units hold what they must."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import LIGHT_WAITS, WHOLE_MODULES, is_light_wait, is_tail_helper, only_unit_tier, unit_of

ROOT = Path(__file__).resolve().parents[2]
_COSTLY_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope=\"(module|package|class)\"")


def test_every_module_with_a_module_scoped_fixture_runs_whole_on_one_worker() -> None:
    # Split over two workers, such a module would build its fixture (a cluster, a wheel) on each.
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
             if _COSTLY_FIXTURE.search(p.read_text())}
    assert found, "the pattern finds the module-scoped fixtures"
    for module in found:
        assert unit_of(f"{module}::test_x") == unit_of(f"{module}::test_y"), f"{module} would be split"
    assert found - WHOLE_MODULES <= {m for m in found if m.startswith("tests/spark/")}


def test_the_spark_tests_are_one_unit_and_other_tests_their_own() -> None:
    assert unit_of("tests/spark/test_reader.py::test_a") == unit_of("tests/spark/test_rerun.py::test_b")
    producer = "tests/integration/test_producer.py"
    assert unit_of(f"{producer}::test_a") != unit_of(f"{producer}::test_b")
    assert unit_of("tests/unit/test_outbox.py::test_a[1]") == "tests/unit/test_outbox.py::test_a[1]"


def test_the_third_worker_waits_for_a_queue_of_unit_tests_only() -> None:
    assert [is_tail_helper(w) for w in ("gw0", "gw1", "gw2", "gw3")] == [False, False, True, True]
    assert not only_unit_tier(["tests/spark", "tests/unit/test_outbox.py::test_a"])
    assert not only_unit_tier(["tests/unit/test_outbox.py::test_a", "tests/integration/test_producer.py::test_b"])
    assert only_unit_tier(["tests/unit/test_outbox.py::test_a", "tests/unit/test_wheel_install.py"])


def test_the_light_waits_the_helper_takes_early_are_unit_tests_marked_waits() -> None:
    for entry in LIGHT_WAITS:
        module, _, test = entry.partition("::")
        assert module.startswith("tests/unit/"), entry
        source = (ROOT / module).read_text()
        if test:  # one test: the marker right above its def
            assert re.search(rf"@pytest\.mark\.waits[^\n]*\ndef {test}\(", source), entry
        else:  # a whole module: its pytestmark
            assert re.search(r"^pytestmark = .*pytest\.mark\.waits", source, re.M), entry
    assert is_light_wait("tests/unit/test_transactions_mock.py::test_x[1]")
    assert not is_light_wait("tests/unit/test_service_crash.py::test_x")
    assert not is_light_wait("tests/integration/test_producer.py::test_x")
