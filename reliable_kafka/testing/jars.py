"""Finds (and on first use fetches) the Apache Kafka server jars that LocalKafkaCluster runs.

The jars come from Maven Central through the pom beside this module, resolved once into a cache
outside the work tree; a half-finished download is never mistaken for a complete one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from reliable_kafka.errors import ClusterError

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"
_HERE = Path(__file__).resolve().parent / "kafka"
POM = _HERE / "pom.xml"
LOG4J_CONFIG = _HERE / "log4j2.properties"
_COMPLETE = ".complete"


def cache_dir() -> Path:
    """Where the jars live: $RK_KAFKA_LIBS if set, else ~/.cache/reliable-kafka/kafka-<version>/libs."""
    override = os.environ.get("RK_KAFKA_LIBS")
    if override:
        return Path(override).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "reliable-kafka" / f"kafka-{KAFKA_VERSION}" / "libs"


def java_executable() -> str:
    """The java binary ($JAVA_HOME/bin/java first); Kafka 4 brokers need Java 17 or newer."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise ClusterError("java is not on PATH: install a Java 17+ runtime (Debian: openjdk-17-jre-headless)")
    return found


def kafka_libs(*, fetch: bool = True) -> Path:
    """The directory of Kafka server jars, fetched with Maven on first use when `fetch` is true."""
    libs = cache_dir()
    if (libs / _COMPLETE).exists():
        return libs
    if not fetch:
        raise ClusterError(f"Kafka {KAFKA_VERSION} jars are not in {libs}: run `reliable-kafka cluster fetch`")
    mvn = shutil.which("mvn")
    if not mvn:
        raise ClusterError(
            f"Kafka {KAFKA_VERSION} jars are not in {libs} and Maven (mvn) is not on PATH to fetch them: "
            "install Maven, or point RK_KAFKA_LIBS at a directory holding the jars"
        )
    libs.parent.mkdir(parents=True, exist_ok=True)
    # Resolve into a sibling temp dir and rename, so an interrupted download leaves no partial cache.
    staging = Path(tempfile.mkdtemp(prefix="libs-", dir=libs.parent))
    log.info("fetching Kafka %s jars with Maven into %s", KAFKA_VERSION, libs)
    proc = subprocess.run(
        [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={staging}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 or not list(staging.glob("kafka_2.13-*.jar")):
        shutil.rmtree(staging, ignore_errors=True)
        raise ClusterError(
            f"Maven could not fetch Kafka {KAFKA_VERSION} (exit {proc.returncode}): "
            f"{(proc.stdout + proc.stderr).strip()[-2000:]}"
        )
    (staging / _COMPLETE).write_text(KAFKA_VERSION)
    if libs.exists():
        shutil.rmtree(libs)
    staging.rename(libs)
    return libs


def class_archive_path(libs: Path, java: str) -> Path:
    """Where the archive for these jars and this Java runtime lives: beside the jars, named after the
    runtime, so a Java upgrade builds a new one instead of every JVM refusing the old."""
    real = Path(os.path.realpath(java))
    stat = real.stat()
    runtime = hashlib.sha256(f"{real}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return libs.parent / "class-archive" / f"kafka-node-{runtime}.jsa"


def class_archive_options(libs: Path, java: str) -> tuple[str, ...]:
    """The JVM flags that map the Kafka node's class archive (testing/class_archive.py builds it), or
    none when it has not been built."""
    path = class_archive_path(libs, java)
    return (f"-XX:SharedArchiveFile={path}",) if path.is_file() else ()
