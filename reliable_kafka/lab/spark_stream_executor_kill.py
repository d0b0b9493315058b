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
from dataclasses import dataclass
from pathlib import Path

from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import count, read_back, topic_name
from reliable_kafka.lab.programs.stream_driver_proc import CONTROL_MODE, RELIABLE_MODE
from reliable_kafka.lab.spark_stream_driver_kill import Checkpoint, Feed, StreamDriver
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS, LocalKafkaCluster
from reliable_kafka.testing.gates import Feeder, fire_when
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


@dataclass(frozen=True)
class ExecutorKill:
    batch: int  # the micro-batch in flight at the kill
    written: int  # offsets its output had taken in the output topic when its executors died
    landed: bool  # Spark had not committed it: its killed tasks run again


class ExecutorGate:
    """The moment an executor kill bites: both executors run, a micro-batch is mid-write and not committed.

    Ready when (1) the cluster runs both executors, (2) a micro-batch committed since the gate was made (the
    last kill's batch is done), (3) the next batch is planned, (4) input remains beyond it, (5) the output
    grew past what it held when the last commit was seen (so it is the planned batch's output), and (6)
    Spark has not committed that batch, looked at last, right before the kill.
    """

    def __init__(self, cluster: LocalSparkCluster, driver: StreamDriver, checkpoint: Checkpoint,
                 probe: OffsetsProbe, input_topic: str, output_topic: str) -> None:
        self._cluster, self._driver, self._checkpoint, self._probe = cluster, driver, checkpoint, probe
        self._input, self._output = input_topic, output_topic
        self._since = checkpoint.latest_commit()
        self._commit = self._since
        self._base = 0
        self.batch = -1

    def _output_total(self) -> int:
        return sum(self._probe.high_watermarks(self._output).values())

    def ready(self) -> bool:
        if (code := self._driver.exit_code()) is not None:
            raise RuntimeError(f"the {self._driver.mode} driver exited ({code}) before its executors' kill")
        if len(self._cluster.executor_pids()) < 2:
            return False
        latest = self._checkpoint.latest_commit()
        if latest <= self._since:
            return False
        if latest != self._commit:
            self._commit, self._base = latest, self._output_total()
            return False
        batch = latest + 1
        end = self._checkpoint.planned_end(batch)
        if end is None or sum(self._probe.end_offsets(self._input).values()) <= end:
            return False
        if self._output_total() <= self._base or self._checkpoint.committed(batch):
            return False
        self.batch = batch
        return True

    def kill(self) -> ExecutorKill:
        # Both: a task of the batch may run on either single-core executor.
        executors = self._cluster.executor_pids()
        for pid in executors:
            self._cluster.kill_executor(pid)
        written = self._output_total() - self._base
        kill = ExecutorKill(self.batch, written, landed=not self._checkpoint.committed(self.batch))
        log.info("%s: executors %s SIGKILLed with micro-batch %d in flight (%d output offsets written, %s)",
                 self._driver.mode, sorted(executors), kill.batch, kill.written,
                 "not committed: its tasks run again" if kill.landed else "committed just before the kill")
        return kill


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
    input_topic, output_topic = topic_name(NAME, f"{client}-in"), topic_name(NAME, client)
    cluster.create_topic(input_topic, PARTITIONS)
    cluster.create_topic(output_topic, PARTITIONS)
    feed = Feed(conn, input_topic, value_bytes=VALUE_BYTES)
    progress(f"{client}: feeding {FIRST_FEED} records", at)
    feed.feed(FIRST_FEED)
    kills: list[ExecutorKill] = []
    with tempfile.TemporaryDirectory(prefix="rk-lab-stream-") as work, OffsetsProbe(conn) as probe:
        stop_file = Path(work) / "stop"
        driver = StreamDriver(mode, conn, input_topic, output_topic, Path(work),
                              max_offsets_per_trigger=MAX_OFFSETS_PER_TRIGGER,
                              extra_args=["--master", spark.master_url, "--py-files", str(py_files),
                                          "--slow-seconds-per-batch", str(SLOW_S), "--stop-file", str(stop_file),
                                          "--max-seconds", "1200"])
        checkpoint = Checkpoint(driver.checkpoint, input_topic)
        feeder = Feeder(lambda: feed.feed(TOP_UP),
                        lambda: sum(probe.end_offsets(input_topic).values()) - checkpoint.latest_planned_end(),
                        low=LOW_WATER, poll_s=0.5, max_top_ups=20, max_seconds=900, name=f"{NAME}-{client}-feeder")
        try:
            driver.start()
            feeder.start()
            try:
                for n in range(1, KILLS + 1):
                    gate = ExecutorGate(spark, driver, checkpoint, probe, input_topic, output_topic)
                    kills.append(fire_when(gate.ready, gate.kill, what=f"{client} executors SIGKILL {n} of {KILLS}",
                                           rearm=feeder.top_up_now, attempts=GATE_ATTEMPTS, timeout_s=GATE_TIMEOUT_S,
                                           poll_s=0.01))
                    progress(f"{client}: executors SIGKILLed mid-batch ({n} of {KILLS})", at + 0.4 * n / (KILLS + 1))
            finally:
                feeder.stop()  # what was fed is final: the query reads all of it before it stops
            progress(f"{client}: catching up with the {len(feed.acked)} records fed", at + 0.4)
            _caught_up(driver, checkpoint, probe, input_topic)
            stop_file.touch()
            last = driver.wait_finished(checkpoint)
        finally:
            driver.kill()
    landed = [k for k in kills if k.landed]
    detail = (f"{len(kills)} SIGKILLs of both executors with a micro-batch mid-write, {len(landed)} before Spark "
              f"committed it (batches {', '.join(str(k.batch) for k in kills)}; "
              f"{' + '.join(str(k.written) for k in landed) or 0} output offsets of those batches written when "
              f"killed); the query read {last['rows']} rows")
    if client == RELIABLE:
        everything = len(read_back(conn, output_topic, isolation_level="read_uncommitted"))
        committed = len(read_back(conn, output_topic))
        detail += f"; {everything - committed} records of aborted transactions hidden from read_committed"
    return count(NAME, client, feed.acked, conn, output_topic, started, detail)


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
