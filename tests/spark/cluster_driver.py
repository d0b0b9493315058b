"""The driver of the standalone-cluster tests, run as its own process: `python -m tests.spark.cluster_driver SPEC`.

A process holds one SparkContext, and the test process already holds the local session, so a job on
the cluster gets a driver of its own. It is set up the way docs/spark.md ("Running on a cluster")
tells users to: the package shipped to the executors as a zip (spark.submit.pyFiles, what --py-files
sets) and the executors' Python named by PYSPARK_PYTHON. It prints one JSON line: what the write did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import urllib.request
from typing import Any


def _module_file_on_executors(spark: Any) -> list[str]:
    """Where the executors' Python workers import reliable_kafka from (one small task per executor slot)."""

    def where(_: Any) -> list[str]:
        import reliable_kafka

        return [str(reliable_kafka.__file__)]

    return sorted(set(spark.sparkContext.parallelize(range(4), 4).flatMap(where).collect()))


def _tasks(spark: Any, stage_ids: list[int], timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Every task attempt of the stages, once none is running (a speculation's loser is killed after the
    job ended): index, attempt, status (SUCCESS / KILLED / FAILED), speculative, errorMessage."""
    base = f"{spark.sparkContext.uiWebUrl}/api/v1/applications/{spark.sparkContext.applicationId}"
    deadline = time.monotonic() + timeout_s
    while True:
        tasks = []
        for stage in stage_ids:
            with urllib.request.urlopen(f"{base}/stages/{stage}/0/taskList?length=1000", timeout=10) as rsp:
                tasks += json.loads(rsp.read())
        if all(t["status"] not in ("RUNNING", "UNKNOWN") for t in tasks) or time.monotonic() > deadline:
            keys = ("index", "attempt", "status", "speculative", "host", "duration", "errorMessage")
            return [{k: t.get(k) for k in keys} for t in tasks]
        time.sleep(0.5)


def _slow_rules(spec: dict[str, Any]) -> list[Any]:
    """The spec's "slow" entries as faults.Slow rules (attempts and partitions: a list, or None for all)."""
    from reliable_kafka.spark.faults import Slow

    def chosen(value: Any) -> tuple[int, ...] | None:
        return tuple(value) if value is not None else None

    return [Slow(s["seconds_per_batch"], attempts=chosen(s.get("attempts")), partitions=chosen(s.get("partitions")),
                 after_batches=s.get("after_batches", 0)) for s in spec["slow"]]


def values_digest(values: list[bytes]) -> dict[str, Any]:
    """How many values, how many distinct, and a digest of them sorted (the order they were read in does not
    count): equal for equal multisets."""
    digest = hashlib.sha256()
    for value in sorted(values):
        digest.update(len(value).to_bytes(4, "big") + value)
    return {"rows": len(values), "distinct": len(set(values)), "sha256": digest.hexdigest()}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    # The executors' Python: an interpreter every node has at this path, with pyspark, pyarrow and
    # confluent-kafka installed (reliable_kafka itself comes in the zip).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # loopback only, whatever the host name resolves to
    from pyspark.sql import SparkSession

    from reliable_kafka.spark import read_kafka, write_kafka
    from reliable_kafka.spark.api import register
    from reliable_kafka.spark.faults import slow_attempts
    from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS
    from reliable_kafka.testing.spark_cluster import driver_conf
    from tests.spark.jobs import numbered_frame

    # What docs/spark.md "Running on a cluster" says a driver sets (the zip, loopback), the UI on (its REST API
    # tells how each task attempt ended: killed is not failed), and the JIT's first tier only, as for the
    # suite's other JVMs (QUICK_START_JVM_OPTIONS): the driver and each executor (a killed one's replacement
    # too) start a JVM for a small job, on two busy cores.
    conf = driver_conf(spec["master"], spec["py_files"], ui_port=spec["ui_port"], jvm_options=QUICK_START_JVM_OPTIONS,
                       tmpdir=spec.get("tmpdir"))
    builder = SparkSession.builder.appName(spec.get("app", "reliable-kafka-cluster-test"))
    for key, value in {**conf, "spark.sql.execution.arrow.maxRecordsPerBatch": "250"}.items():
        builder = builder.config(key, value)
    for key, value in spec.get("conf", {}).items():
        builder = builder.config(key, str(value))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(spec.get("log_level", "WARN"))
    try:
        register(spark)
        # Where the executors import the package from (a small job first; "probe": false leaves it out).
        module_files = _module_file_on_executors(spark) if spec.get("probe", True) else []
        df, _ = numbered_frame(spark, spec["write_id"], partitions=spec["partitions"],
                               rows_per_partition=spec["rows_per_partition"], value_bytes=spec.get("value_bytes", 0))
        if spec.get("slow"):
            df = slow_attempts(df, *_slow_rules(spec))
        spark.sparkContext.setJobGroup("write", "the write under test")
        result = write_kafka(df, spec["bootstrap"], spec["topic"], guarantee="exactly_once",
                             write_id=spec["write_id"], num_partitions=spec["partitions"],
                             options=spec.get("options", {}))
        tracker = spark.sparkContext.statusTracker()
        stage_ids = sorted({s for j in tracker.getJobIdsForGroup("write") if (job := tracker.getJobInfo(j))
                            for s in job.stageIds})
        tasks = _tasks(spark, stage_ids)
        assert result.manifest is not None
        # Our reader on the cluster: what its executors read of the topic, to hold against an independent read
        # ("read_back": false leaves it out).
        read = None
        if spec.get("read_back", True):
            rows = read_kafka(spark, spec["bootstrap"], subscribe=spec["topic"]).df.select("value").collect()
            read = values_digest([bytes(r.value) for r in rows])
        return {
            "read": read,
            "rows": result.manifest.rows,
            "partitions": {str(p): {"attempt": m.attempt, "rows_written": m.rows_written}
                           for p, m in result.manifest.partitions.items()},
            "tasks": tasks,
            "module_files": module_files,
        }
    finally:
        spark.stop()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
