"""A real local Spark session for the connector tests (one per test session), plus helpers to build and check jobs.

local[2,4]: two cores, and up to four attempts per task, so an injected failure is retried the way a
cluster retries it (plain local[2] allows a single attempt). Spark's own Kafka connector is on the
classpath for the control runs when Maven could fetch it. `spark_cluster` is a real standalone
cluster (Master + 2 Workers on distinct loopback hosts) for the tests that need executors to die or
to be speculated on another host.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
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
    from reliable_kafka.spark.jars import has_kafka_connector

    if not has_kafka_connector(spark_session):
        missing("Spark's Kafka connector (spark-sql-kafka-0-10)", "needs Maven and Maven Central; see docs/spark.md")


@dataclass(frozen=True)
class SparkClusterForTests:
    """The suite's standalone cluster and what its drivers need: the package zip they ship (--py-files)."""

    cluster: Any  # LocalSparkCluster
    py_files: str
    tmpdir: str  # the JVMs' java.io.tmpdir (a SIGKILLed executor leaves its native libraries there)

    def submit(self, spec: dict[str, Any], log_path: Path) -> subprocess.Popen[str]:
        """Run tests/spark/cluster_driver.py with `spec` as a driver process of its own (see its docstring);
        its log (Spark's, at WARN, and ours) goes to `log_path`."""
        full = {"master": self.cluster.master_url, "py_files": self.py_files, "tmpdir": self.tmpdir, **spec}
        with open(log_path, "w") as log:
            return subprocess.Popen([sys.executable, "-m", "tests.spark.cluster_driver", json.dumps(full)],
                                    stdout=subprocess.PIPE, stderr=log, text=True, cwd=_REPO)


_REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkClusterForTests]:
    """A Spark standalone Master and two Workers (1 core, 1 GB each) on hosts 127.0.0.2 and 127.0.0.3.

    The jobs run in driver processes of their own (this process holds the local session): each ships
    the package as a zip, as docs/spark.md tells users to, and the Workers are started without this
    process's PYTHONPATH, so the executors find reliable_kafka only through the zip.
    """
    if not shutil.which("java"):
        missing("java", "install a Java 17+ runtime (Spark needs it)")
    if importlib.util.find_spec("pyspark") is None or importlib.util.find_spec("pyarrow") is None:
        missing("pyspark and pyarrow", "pip install -e '.[spark]'")
    from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS
    from reliable_kafka.testing.spark_cluster import LocalSparkCluster, package_zip

    zipped = str(package_zip(tmp_path_factory.mktemp("py-files")))
    tmpdir = str(tmp_path_factory.mktemp("spark-jvm-tmp"))
    with LocalSparkCluster(workers=2, worker_cores=1, worker_memory_mb=1024,
                           jvm_options=QUICK_START_JVM_OPTIONS, env={"PYTHONPATH": ""}) as cluster:
        yield SparkClusterForTests(cluster, zipped, tmpdir)
