"""Finds (and on first use fetches) Spark's own Kafka connector jars, the baseline our connector is measured against.

The connector (spark-sql-kafka-0-10, with kafka-clients, the token provider and commons-pool2) must
match the installed Spark closely enough that both its sink and its reader run: the installed Spark's
own version first, else the newest release Maven serves that is known to work with it; a version known
to break (its reader) is never picked, not even from the cache. The jars come from Maven Central
through the pom beside this module, resolved once into a cache outside the work tree; a half-finished
download is never mistaken for a complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from reliable_kafka.errors import ClusterError

log = logging.getLogger(__name__)

POM = Path(__file__).resolve().parent / "pom.xml"
# Used, newest first, when the installed Spark's own connector is not published (yet) where Maven
# looks. Only releases whose reader AND sink were seen working with the newer Spark belong here:
# tests/spark/test_connector.py reads and writes a topic with format("kafka") on the installed Spark.
FALLBACK_VERSIONS: tuple[str, ...] = ("4.2.0", "4.1.1")
# Spark 4.1 turned the log keys (org.apache.spark.internal.LogKeys) from a Scala object into a Java
# enum: a 4.0.x connector's sink still runs on 4.1+, its reader dies with
# NoClassDefFoundError: org/apache/spark/internal/LogKeys$CONSUMER$. So below 4.1 the connector must
# come from the same minor release line as Spark, and from 4.1 on it must be 4.1 or newer.
_LOG_KEYS_SPLIT = (4, 1)
_COMPLETE = ".complete"
# A version Maven Central does not serve is asked for again only after this long: the question costs
# a Maven start (seconds) in every session, the answer changes on a release day.
_ASK_AGAIN_S = 24 * 3600
# Spark's own jars (spark-tags, hadoop, scala) ship with pyspark: only the connector's own are copied.
_ARTIFACTS = "spark-sql-kafka-0-10_2.13,spark-token-provider-kafka-0-10_2.13,kafka-clients,commons-pool2"


def installed_spark_version() -> str:
    import pyspark

    return str(pyspark.__version__)


def cache_dir(version: str) -> Path:
    """~/.cache/reliable-kafka/spark-sql-kafka-<version> (under $XDG_CACHE_HOME when set)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "reliable-kafka" / f"spark-sql-kafka-{version}"


def _release(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of "4.2.0" or "4.3.0.dev1"; unparsable parts count as 0."""
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def compatible(connector: str, spark: str) -> bool:
    """Whether Spark `spark` can run the Kafka connector `connector` (its reader as well as its sink).

    The same release always can. Otherwise the connector must be of the same major version, not newer
    than Spark, and on the same side of the log keys change in 4.1 (see _LOG_KEYS_SPLIT); below 4.1,
    of the same minor release line.
    """
    c, s = _release(connector), _release(spark)
    if c == s:
        return True
    if c[0] != s[0] or c > s:
        return False
    if s[:2] < _LOG_KEYS_SPLIT:
        return c[:2] == s[:2]
    return c[:2] >= _LOG_KEYS_SPLIT


def candidate_versions(spark: str) -> list[str]:
    """The connector versions to try for Spark `spark`, best first: its own, then FALLBACK_VERSIONS that fit."""
    pinned = os.environ.get("RK_SPARK_KAFKA_VERSION")
    if pinned:
        return [pinned]
    return [spark] + [v for v in FALLBACK_VERSIONS if v != spark and compatible(v, spark)]


def _missing_marker(version: str) -> Path:
    return cache_dir(version).with_name(f"spark-sql-kafka-{version}.not-on-maven")


def _known_missing(version: str) -> str | None:
    """Maven's answer when it said, less than _ASK_AGAIN_S ago, that it does not serve `version`."""
    marker = _missing_marker(version)
    try:
        if time.time() - marker.stat().st_mtime < _ASK_AGAIN_S:
            return marker.read_text()
    except OSError:
        pass
    return None


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
        said = (proc.stdout + proc.stderr).strip()
        # Maven says it one of two ways: first "Could not find artifact", later "was not found in".
        missing = [line for line in said.splitlines()
                   if f"spark-sql-kafka-0-10_2.13:jar:{version}" in line
                   and ("Could not find artifact" in line or "was not found in" in line)]
        if missing:
            answer = "not served by Maven Central"
            _missing_marker(version).write_text(answer)
            return answer
        return f"exit {proc.returncode}: {said[-1500:]}"
    (staging / _COMPLETE).write_text(version)
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return None


def _jars(version: str, directory: Path) -> list[Path]:
    if version != installed_spark_version():
        log.info("Spark's Kafka connector %s is used with Spark %s (the latter's own is not on Maven Central)",
                 version, installed_spark_version())
    return sorted(directory.glob("*.jar"))


def spark_kafka_version(*, fetch: bool = True) -> str:
    """The connector version spark_kafka_jars() uses (fetching it when needed)."""
    return _resolve(fetch=fetch)[0]


def spark_kafka_jars(*, fetch: bool = True) -> list[Path]:
    """The jar files to put on spark.jars for format("kafka"), fetched with Maven on first use.

    Tries the installed Spark's version first, then the FALLBACK_VERSIONS compatible with it, newest
    first; RK_SPARK_KAFKA_VERSION pins one, and RK_SPARK_KAFKA_JARS names a directory of jars to use
    as they are. Raises ClusterError naming every version tried and why it was not used.
    """
    return _resolve(fetch=fetch)[1]


def _resolve(*, fetch: bool) -> tuple[str, list[Path]]:
    override = os.environ.get("RK_SPARK_KAFKA_JARS")
    if override:
        jars = sorted(Path(override).expanduser().glob("*.jar"))
        if not jars:
            raise ClusterError(f"RK_SPARK_KAFKA_JARS={override} holds no jar")
        found = [j.name for j in jars if j.name.startswith("spark-sql-kafka-0-10_2.13-")]
        return (found[0].removeprefix("spark-sql-kafka-0-10_2.13-").removesuffix(".jar") if found else "?"), jars
    spark = installed_spark_version()
    versions = candidate_versions(spark)
    problems = []
    # In order of preference: a better version Maven said it lacks is not asked for again for a day.
    for version in versions:
        if (cache_dir(version) / _COMPLETE).exists():
            return version, _jars(version, cache_dir(version))
        if (answer := _known_missing(version)) is not None:
            problems.append(f"{version}: {answer}")
            continue
        if not fetch:
            problems.append(f"{version}: not cached in {cache_dir(version)} and fetching is off")
            continue
        problem = _fetch(version, cache_dir(version))
        if problem is None:
            return version, _jars(version, cache_dir(version))
        problems.append(f"{version}: {problem}")
    raise ClusterError(
        f"Spark's Kafka connector (spark-sql-kafka-0-10) for Spark {spark} could not be had; tried "
        + " | ".join(problems)
        + f". Releases older than {'.'.join(map(str, _LOG_KEYS_SPLIT))} do not work with Spark "
        f"{'.'.join(map(str, _LOG_KEYS_SPLIT))}+ (their reader fails). Point RK_SPARK_KAFKA_JARS at a directory "
        "holding a matching connector's jars, or RK_SPARK_KAFKA_VERSION at a release Maven can fetch"
    )


def has_kafka_connector(spark: Any) -> bool:
    """Whether format("kafka") (Spark's own Kafka connector) can be used in this session."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        loader = jvm.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName("org.apache.spark.sql.kafka010.KafkaSourceProvider", True, loader)
    except Exception:
        return False
    return True
