"""A small local Spark session for tests, the lab and the benchmark (2 cores, modest memory, loopback only).

Tasks may fail and be retried (local[N,F] allows F attempts; plain local[N] allows one), the Python
workers run this interpreter, and Spark's own Kafka connector is on the classpath when asked for.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

from pyspark.sql import SparkSession

from reliable_kafka.spark.api import register
from reliable_kafka.spark.jars import spark_kafka_jars

log = logging.getLogger(__name__)


def local_session(
    *,
    app_name: str = "reliable-kafka",
    cores: int = 2,
    task_attempts: int = 4,
    with_kafka_connector: bool = True,
    conf: Mapping[str, Any] | None = None,
) -> SparkSession:
    """Start (or return the running) local session with format("reliable_kafka") registered.

    with_kafka_connector puts Spark's own format("kafka") on the classpath (the baseline); it only
    takes effect when this call starts the JVM.
    """
    # Spark binds to the host's outward address unless told otherwise; keep all traffic on loopback.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Workers must run this interpreter (its packages, reliable_kafka included); Spark reads the
    # environment variable, and falls back to whatever "python3" is first on PATH.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(f"local[{cores},{task_attempts}]")
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "1g")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", str(2 * cores))
        .config("spark.default.parallelism", str(2 * cores))
        .config("spark.sql.session.timeZone", "UTC")
    )
    if with_kafka_connector:
        builder = builder.config("spark.jars", ",".join(str(j) for j in spark_kafka_jars()))
    for key, value in (conf or {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
