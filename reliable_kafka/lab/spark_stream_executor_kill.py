"""Lab scenario `spark-stream-executor-kill` (failure mode L9, streaming, on a cluster): a Kafka -> Spark
Structured Streaming -> Kafka query runs on a real standalone cluster (testing.spark_cluster: a Master and
two Workers, one single-core executor each), and both executors are SIGKILLed, each with the Python
workers it started, 3 times while a micro-batch's tasks are writing. Spark retries the lost tasks on the
executors its Workers start again; the driver lives on.

Each kill is gated on what the checkpoint, the output topic and the cluster show, never on a sleep: both
executors run, a micro-batch has committed since the last kill (the retried one is done), the next one is
planned, input remains beyond it, its output has begun and Spark has not committed it. Every task passes
its Arrow batches on a quarter of a second apart (spark.faults.slow_attempts, both clients), so a task
writes for about 2 s and a kill finds it mid-write.

Spark's own Kafka source and sink (the control) write the killed tasks' records again when Spark retries
them; reliable_kafka's source and exactly_once sink abort the killed tasks' transactions (the retry, with
the same transactional.id, fences them) and write each record once. After the third kill the feed stops;
once the checkpoint shows the whole input committed the driver stops its query, and an independent
read_committed reader counts what was lost and duplicated against what the feeder's producer got
acknowledged.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.programs.stream_driver_proc import CONTROL_MODE, RELIABLE_MODE
from reliable_kafka.lab.spark_stream_driver_kill import (
    Checkpoint,
    InFlightGate,
    StreamDriver,
    backlog_feeder,
    fed_topics,
    kills_mid_batch,
    kills_summary,
    pipeline_result,
)
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS, LocalKafkaCluster
from reliable_kafka.testing.offsets_probe import OffsetsProbe
from reliable_kafka.testing.spark_cluster import LocalSparkCluster, package_zip

log = logging.getLogger(__name__)

NAME = "spark-stream-executor-kill"
KILLS = 3
PARTITIONS = 2  # input and output: one task per input partition, one per Worker's single core
# 2,000 records a task, 8 Arrow batches of 250 records of VALUE_BYTES (about 100 KB each, more than the
# 64 KB in which a Python worker's output passes on: the writer gets them while they are made), each passed
# on SLOW_S after the last: a task writes for about 2 s.
MAX_OFFSETS_PER_TRIGGER = 4_000
VALUE_BYTES = 400
SLOW_S = 0.25
# The input holds FIRST_FEED records before the query starts; the feeder adds TOP_UP whenever fewer than
# LOW_WATER are left unplanned, until the last kill: the query cannot run dry before its kills.
FIRST_FEED = 16_000
TOP_UP = 8_000
LOW_WATER = 8_000
# Bounds of every wait: a gate's (per attempt, re-armed by a top-up; a killed executor's replacement took
# 25-40 s to run tasks on a loaded host), the catch-up after the last kill (it gives up when no micro-batch
# commits for STALL_S).
GATE_TIMEOUT_S = 120.0
GATE_ATTEMPTS = 3
CATCH_UP_TIMEOUT_S = 600.0
STALL_S = 120.0


class ExecutorGate(InFlightGate):
    """The moment an executor kill bites: InFlightGate's micro-batch mid-write and not committed, with both
    executors running (a task of the batch may run on either single-core executor); the kill takes both."""

    LANDED = "not committed: its tasks run again"

    def __init__(self, cluster: LocalSparkCluster, driver: StreamDriver, checkpoint: Checkpoint,
                 probe: OffsetsProbe, input_topic: str, output_topic: str) -> None:
        super().__init__(driver, checkpoint, probe, input_topic, output_topic)
        self._cluster = cluster

    def _armed(self) -> bool:
        return len(self._cluster.executor_pids()) >= 2

    def _strike(self) -> str:
        executors = self._cluster.executor_pids()
        for pid in executors:
            self._cluster.kill_executor(pid)
        return f"executors {sorted(executors)} SIGKILLed"


def _caught_up(driver: StreamDriver, checkpoint: Checkpoint, probe: OffsetsProbe, input_topic: str) -> None:
    """Wait until Spark committed output for the whole input (the feed has stopped). Bounded by
    CATCH_UP_TIMEOUT_S, and gated on progress: gives up when no micro-batch committed for STALL_S."""
    end = sum(probe.end_offsets(input_topic).values())
    deadline = time.monotonic() + CATCH_UP_TIMEOUT_S
    last, moved = checkpoint.latest_commit(), time.monotonic()
    while checkpoint.committed_end() < end:
        now = time.monotonic()
        if (code := driver.exit_code()) is not None:
            raise RuntimeError(f"the {driver.mode} driver exited ({code}) before it caught up with its input")
        if (latest := checkpoint.latest_commit()) != last:
            last, moved = latest, now
        if now > deadline or now - moved > STALL_S:
            raise RuntimeError(f"the {driver.mode} query did not catch up: {checkpoint.committed_end()} of {end} "
                               f"input offsets committed, {now - moved:.0f}s since the last commit")
        time.sleep(0.5)


def _pipeline(cluster: LocalKafkaCluster, spark: LocalSparkCluster, py_files: Path, client: str, mode: str,
              progress: Progress, at: float) -> ScenarioResult:
    conn = cluster.client_config()
    started = time.monotonic()
    input_topic, output_topic, feed = fed_topics(cluster, NAME, client, PARTITIONS, FIRST_FEED, progress, at,
                                                 value_bytes=VALUE_BYTES)
    with tempfile.TemporaryDirectory(prefix="rk-lab-stream-") as work, OffsetsProbe(conn) as probe:
        stop_file = Path(work) / "stop"
        driver = StreamDriver(mode, conn, input_topic, output_topic, Path(work),
                              max_offsets_per_trigger=MAX_OFFSETS_PER_TRIGGER,
                              extra_args=["--master", spark.master_url, "--py-files", str(py_files),
                                          "--slow-seconds-per-batch", str(SLOW_S), "--stop-file", str(stop_file),
                                          "--max-seconds", "1200"])
        checkpoint = Checkpoint(driver.checkpoint, input_topic)
        feeder = backlog_feeder(feed, probe, checkpoint, TOP_UP, low=LOW_WATER, max_top_ups=20,
                                name=f"{NAME}-{client}-feeder")
        try:
            driver.start()
            feeder.start()
            # What was fed is final once the kills are done: the query reads all of it before it stops.
            kills = kills_mid_batch(lambda: ExecutorGate(spark, driver, checkpoint, probe, input_topic, output_topic),
                                    feeder, what=f"{client}: executors SIGKILL", attempts=GATE_ATTEMPTS,
                                    timeout_s=GATE_TIMEOUT_S, progress=progress, at=at, count=KILLS)
            progress(f"{client}: catching up with the {len(feed.acked)} records fed", at + 0.4)
            _caught_up(driver, checkpoint, probe, input_topic)
            stop_file.touch()
            last = driver.wait_finished(checkpoint)
        finally:
            driver.kill()
    detail = f"{kills_summary(kills, 'SIGKILLs of both executors')}; the query read {last['rows']} rows"
    return pipeline_result(NAME, client, conn, feed, output_topic, started, detail)


def run(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    with tempfile.TemporaryDirectory(prefix="rk-lab-spark-") as work:
        py_files = package_zip(work)
        progress("starting a Spark standalone cluster (a Master, 2 Workers)", 0.0)
        # The Workers (and so the executors) without this process's PYTHONPATH: the executors import the
        # package from the zip the driver ships, as on a real cluster.
        with LocalSparkCluster(workers=2, worker_cores=1, worker_memory_mb=1024, jvm_options=QUICK_START_JVM_OPTIONS,
                               env={"PYTHONPATH": ""}) as spark:
            results = [_pipeline(cluster, spark, py_files, CONTROL, CONTROL_MODE, progress, 0.0)]
            results.append(_pipeline(cluster, spark, py_files, RELIABLE, RELIABLE_MODE, progress, 0.5))
    progress("done", 1.0)
    return results


SCENARIO = Scenario(
    name=NAME,
    description="L9 Spark streaming executor kill: a Kafka -> Structured Streaming -> Kafka query on a standalone "
    "cluster has both executors SIGKILLed 3 times mid-batch: Spark's Kafka source and sink write the retried "
    "tasks' records twice, reliable_kafka's source and exactly_once sink write each record once",
    run=run,
    needs=("spark",),
)
