"""A real local Spark session for the connector tests (one per test session), plus helpers to build and check jobs.

local[2,4]: two cores, and up to four attempts per task, so an injected failure is retried the way a
cluster retries it (plain local[2] allows a single attempt). Spark's own Kafka connector is on the
classpath for the control runs when Maven could fetch it.
"""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fixtures.requirements import missing


@pytest.fixture(scope="session")
def spark_session() -> Iterator[Any]:
    if not shutil.which("java"):
        missing("java", "install a Java 17+ runtime (Spark needs it)")
    if importlib.util.find_spec("pyspark") is None or importlib.util.find_spec("pyarrow") is None:
        missing("pyspark and pyarrow", "pip install -e '.[spark]'")
    from reliable_kafka.errors import ClusterError
    from reliable_kafka.spark.jars import spark_kafka_jars
    from reliable_kafka.spark.local import local_session
    from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS

    try:
        spark_kafka_jars()
        with_connector = True
    except ClusterError:
        with_connector = False  # the control tests report it through missing()
    spark = local_session(
        app_name="reliable-kafka-tests",
        with_kafka_connector=with_connector,
        # Small Arrow batches: a failure "after N rows" lands inside a partition, not at its end.
        conf={"spark.sql.execution.arrow.maxRecordsPerBatch": 250,
              # The JIT's first tier only, as for the suite's Kafka nodes (QUICK_START_JVM_OPTIONS): these
              # jobs are small, and the optimising compiler's work does not pay off in them.
              "spark.driver.extraJavaOptions": " ".join(QUICK_START_JVM_OPTIONS)},
    )
    try:
        yield spark
    finally:
        spark.stop()


@pytest.fixture
def spark(spark_session: Any) -> Any:
    return spark_session


@pytest.fixture
def kafka_connector(spark_session: Any) -> None:
    """Spark's own format("kafka") (the control); missing() when its jars could not be fetched."""
    from reliable_kafka.spark.local import has_kafka_connector

    if not has_kafka_connector(spark_session):
        missing("Spark's Kafka connector (spark-sql-kafka-0-10)", "needs Maven and Maven Central; see docs/spark.md")
