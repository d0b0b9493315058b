"""Finds (and on first use fetches) Spark's own Kafka connector jars, the baseline our connector is measured against.

The jars (spark-sql-kafka-0-10 for the installed Spark, with kafka-clients, the token provider and
commons-pool2) come from Maven Central through the pom beside this module, resolved once into a
cache outside the work tree; a half-finished download is never mistaken for a complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from reliable_kafka.errors import ClusterError

log = logging.getLogger(__name__)

POM = Path(__file__).resolve().parent / "pom.xml"
# Used when the installed Spark's own connector is not published (yet) where Maven looks: the Kafka
# data source API has been stable across Spark 4.x, and the tests check this pairing works.
FALLBACK_VERSION = "4.0.0"
_COMPLETE = ".complete"
# Spark's own jars (spark-tags, hadoop, scala) ship with pyspark: only the connector's own are copied.
_ARTIFACTS = "spark-sql-kafka-0-10_2.13,spark-token-provider-kafka-0-10_2.13,kafka-clients,commons-pool2"


def installed_spark_version() -> str:
    import pyspark

    return str(pyspark.__version__)


def cache_dir(version: str) -> Path:
    """~/.cache/reliable-kafka/spark-sql-kafka-<version> (under $XDG_CACHE_HOME when set)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "reliable-kafka" / f"spark-sql-kafka-{version}"


def _versions() -> list[str]:
    pinned = os.environ.get("RK_SPARK_KAFKA_VERSION")
    if pinned:
        return [pinned]
    installed = installed_spark_version()
    return [installed] if installed == FALLBACK_VERSION else [installed, FALLBACK_VERSION]


def _fetch(version: str, target: Path) -> str | None:
    """Resolve one version into `target`; None on success, else Maven's complaint."""
    mvn = shutil.which("mvn")
    if not mvn:
        return "Maven (mvn) is not on PATH"
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="jars-", dir=target.parent))
    log.info("fetching spark-sql-kafka-0-10 %s with Maven into %s", version, target)
    proc = subprocess.run(
        [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", f"-Dspark.version={version}",
         f"-DoutputDirectory={staging}", f"-DincludeArtifactIds={_ARTIFACTS}"],
        capture_output=True, text=True, check=False,
    )
    if proc.returncode != 0 or not list(staging.glob("spark-sql-kafka-0-10_2.13-*.jar")):
        shutil.rmtree(staging, ignore_errors=True)
        return f"exit {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-1500:]}"
    (staging / _COMPLETE).write_text(version)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return None


def _jars(version: str, directory: Path) -> list[Path]:
    if version != installed_spark_version():
        log.warning("Spark's Kafka connector %s is used with Spark %s (the latter's own is not available)",
                    version, installed_spark_version())
    return sorted(directory.glob("*.jar"))


def spark_kafka_jars(*, fetch: bool = True) -> list[Path]:
    """The jar files to put on spark.jars for format("kafka"), fetched with Maven on first use.

    Tries the installed Spark's version first, then FALLBACK_VERSION; RK_SPARK_KAFKA_VERSION pins one,
    and RK_SPARK_KAFKA_JARS names a directory of jars to use as they are.
    """
    override = os.environ.get("RK_SPARK_KAFKA_JARS")
    if override:
        jars = sorted(Path(override).expanduser().glob("*.jar"))
        if not jars:
            raise ClusterError(f"RK_SPARK_KAFKA_JARS={override} holds no jar")
        return jars
    versions = _versions()
    # A cached set wins over a download: once the fallback is cached, no session waits on Maven again.
    for version in versions:
        if (cache_dir(version) / _COMPLETE).exists():
            return _jars(version, cache_dir(version))
    problems = []
    for version in versions if fetch else ():
        problem = _fetch(version, cache_dir(version))
        if problem is None:
            return _jars(version, cache_dir(version))
        problems.append(f"{version}: {problem}")
    if not fetch:
        problems.append(f"not cached in {cache_dir(versions[0])} and fetching is off")
    raise ClusterError(
        "Spark's Kafka connector (spark-sql-kafka-0-10) could not be fetched: " + " | ".join(problems)
        + "; point RK_SPARK_KAFKA_JARS at a directory holding its jars"
    )
