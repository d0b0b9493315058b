"""Shared test set-up: the real-part fixtures, and how the suite is split across two pytest-xdist workers.

`./dev test` runs two workers with `--dist loadgroup`. The tests that touch a real Kafka cluster or Spark
go into one of two groups, and each group runs on one worker against that worker's own cluster: the
Spark tests and a few integration modules in one, the rest of the integration tests (the producer,
consumer and transaction fault tests) in the other, which roughly halves the wall time on a 2-core
machine. The tests that need no cluster (the librdkafka mock, the outbox, SQLite, Redis) fill in on
whichever worker is free. Never more than two clusters run at once (plus the doctor's short-lived one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.kafka",
    "tests.fixtures.redis",
    "tests.fixtures.members",
]

# A test that asks for one of these needs a real cluster (or Spark, which writes to one).
_CLUSTER_FIXTURES = frozenset({"kafka", "kafka_session", "make_topic", "weak_cluster", "spark", "spark_session",
                               "kafka_connector"})
# Integration modules that share the Spark tests' worker, to balance the two (measured wall times).
_WITH_SPARK = frozenset({"test_doctor.py", "test_examples.py", "test_first_contact.py", "test_dedup_consumer.py",
                         "test_telemetry.py"})


# tryfirst: xdist reads the groups in its own hook of the same name.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not _CLUSTER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            continue
        path = Path(str(item.fspath))
        group = "cluster-spark" if path.parent.name == "spark" or path.name in _WITH_SPARK else "cluster-faults"
        item.add_marker(pytest.mark.xdist_group(group))
