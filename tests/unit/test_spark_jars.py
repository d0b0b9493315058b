"""Which release of Spark's Kafka connector may run on which Spark (the reader breaks across 4.0 / 4.1)."""

from __future__ import annotations

import pytest

from reliable_kafka.spark.jars import candidate_versions, compatible


@pytest.mark.parametrize(("connector", "spark", "ok"), [
    ("4.3.0", "4.3.0", True),
    ("4.2.0", "4.3.0", True),
    ("4.1.1", "4.3.0", True),
    ("4.0.0", "4.3.0", False),   # its reader: NoClassDefFoundError LogKeys$CONSUMER$
    ("4.0.0", "4.0.2", True),
    ("4.1.1", "4.0.2", False),   # newer than Spark
    ("4.4.0", "4.3.0", False),
    ("3.5.1", "4.3.0", False),   # another major version
    ("4.2.0", "4.3.0.dev1", True),
])
def test_connector_compatibility(connector: str, spark: str, ok: bool) -> None:
    assert compatible(connector, spark) is ok


def test_candidates_put_the_installed_spark_first_and_skip_what_cannot_work(monkeypatch) -> None:
    monkeypatch.delenv("RK_SPARK_KAFKA_VERSION", raising=False)
    assert candidate_versions("4.3.0") == ["4.3.0", "4.2.0", "4.1.1"]
    assert candidate_versions("4.0.1") == ["4.0.1"]
    monkeypatch.setenv("RK_SPARK_KAFKA_VERSION", "4.1.1")
    assert candidate_versions("4.3.0") == ["4.1.1"]
