"""Lab scenario `spark-stream-driver-kill` (failure mode L9, streaming): the driver of a Kafka -> Spark
Structured Streaming -> Kafka pipeline is SIGKILLed 3 times mid-stream and restarted from its checkpoint.

The driver is a process of its own (lab.programs.stream_driver_proc: one local Spark session, its JVM and
Python workers its children). Each kill is gated on what the checkpoint and the output topic show, never
on a sleep: a micro-batch has committed since the driver's restart, the next one is planned (its offsets
are in `offsets/`), its output has begun (the output topic grew since the last commit) and Spark has not
committed it (no file in `commits/` yet), and input remains beyond it. The restarted driver replays that
micro-batch. Spark's own Kafka sink (the control, with Spark's own source) writes the replayed records a
second time; reliable_kafka's source and exactly_once sink write each record once. After the third kill the
feed stops and a last driver run with Trigger.AvailableNow reads the rest; an independent read_committed
reader counts what was lost and duplicated against what the feeder's acks=all producer got acknowledged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import count, read_back, topic_name
from reliable_kafka.lab.programs.stream_driver_proc import CONTROL_MODE, RELIABLE_MODE
from reliable_kafka.testing.child_connection import Connection, child_env
from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.gates import Feeder, fire_when
from reliable_kafka.testing.offsets_probe import OffsetsProbe

log = logging.getLogger(__name__)

NAME = "spark-stream-driver-kill"
KILLS = 3
PARTITIONS = 2  # input and output: one Spark task per input partition, for local[2]'s two cores
MAX_OFFSETS_PER_TRIGGER = 1_000
# The input holds FIRST_FEED records before the first driver starts; the feeder adds TOP_UP whenever fewer
# than LOW_WATER are left unplanned, until the last kill: no driver can run dry before its kill.
FIRST_FEED = 20_000
TOP_UP = 5_000
LOW_WATER = 5_000
# Bounds of every wait: a gate's (per attempt, re-armed by a top-up), a killed driver's descendants', the
# last run's (it gives up when no micro-batch commits for STALL_S).
GATE_TIMEOUT_S = 90.0
GATE_ATTEMPTS = 4
REAP_TIMEOUT_S = 15.0
FINAL_TIMEOUT_S = 600.0
STALL_S = 120.0
# Where the driver's code lives, so a child started from the work directory imports this same copy of it.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# ---- the driver process ------------------------------------------------------------------------


def session_members(sid: int) -> list[int]:
    """Live processes (not zombies) of session `sid` (Linux /proc): a driver started in a session of its
    own and everything it started, pyspark's worker daemon too, which leaves the driver's process group
    (it calls setpgid) but not its session."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone since the listing
        fields = stat.rpartition(")")[2].split()  # after "(comm)": state, ppid, pgrp, session, ...
        if len(fields) > 3 and fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def kill_session(proc: subprocess.Popen[Any], timeout_s: float = REAP_TIMEOUT_S) -> None:
    """SIGKILL `proc`, started with start_new_session=True, and every process of its session: its process
    group first (a driver and its JVM), then what left the group but not the session (pyspark's worker
    daemon and its workers). Returns once none is alive; raises if one outlives `timeout_s`.

    A `proc` already reaped (it exited by itself) is not signalled: its pid may be another's by now, and
    what it started ends with it (Spark's JVM when the driver's gateway pipe closes, the workers with it).
    Until `proc` is reaped its pid, and so its session's id, stays ours: the sweep runs before the reaping.
    """
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    # The leader, killed and not yet reaped, is a zombie: session_members() leaves it out.
    while members := session_members(proc.pid):
        if time.monotonic() > deadline:
            proc.wait()
            raise RuntimeError(f"processes {members} of session {proc.pid} outlived its SIGKILL by {timeout_s:.0f}s")
        for pid in members:
            with contextlib.suppress(ProcessLookupError):  # died since the look
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    proc.wait()


class StreamDriver:
    """Starts the stream driver program in a session of its own, SIGKILLs it with everything it started,
    and starts it again on the same checkpoint. Only that session's processes are ever signalled."""

    def __init__(self, mode: str, connection: Connection, input_topic: str, output_topic: str,
                 workdir: Path, *, max_offsets_per_trigger: int = MAX_OFFSETS_PER_TRIGGER,
                 extra_args: Sequence[str] = ()) -> None:
        self.mode = mode
        self.workdir = workdir
        self.checkpoint = workdir / "checkpoint"
        self._args = ["--mode", mode, "--input", input_topic, "--output", output_topic,
                      "--checkpoint", str(self.checkpoint), "--max-offsets-per-trigger", str(max_offsets_per_trigger),
                      *extra_args]
        tmp = workdir / "tmp"
        tmp.mkdir()
        env = child_env(connection)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
        # Spark's scratch space (block manager, shuffle) and the driver's temp files (the JVM's too, see the
        # program) inside the work directory: a SIGKILLed JVM runs no shutdown hook, and would leave its
        # directories in /tmp on every kill.
        env["SPARK_LOCAL_DIRS"] = str(workdir / "spark-local")
        env["TMPDIR"] = str(tmp)
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    def start(self, *, available_now: bool = False) -> None:
        self.runs += 1
        args = [*self._args, "--available-now"] if available_now else self._args
        with open(self._stdout(self.runs), "wb") as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "reliable_kafka.lab.programs.stream_driver_proc", *args],
                env=self._env, cwd=self.workdir, stdout=out, stderr=None,
                start_new_session=True)  # its own session and process group: the kill reaches its JVM, nothing else
        log.info("%s stream driver run %d: pid %d%s", self.mode, self.runs, self._proc.pid,
                 " (available now)" if available_now else "")

    def _stdout(self, run: int) -> Path:
        return self.workdir / f"driver-{run}.out"

    def exit_code(self) -> int | None:
        """None while the current run is alive."""
        return None if self._proc is None else self._proc.poll()

    def kill(self) -> None:
        """SIGKILL the driver with everything it started: no shutdown hook, no commit, nothing lingers."""
        if self._proc is not None:
            kill_session(self._proc)

    def wait_finished(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """Wait for an available-now run to exit 0 and return its JSON line. Bounded by FINAL_TIMEOUT_S and
        gated on progress: it gives up (killing the run) when no micro-batch committed for STALL_S."""
        proc = self._proc
        assert proc is not None
        deadline = time.monotonic() + FINAL_TIMEOUT_S
        last, moved = checkpoint.latest_commit(), time.monotonic()
        while proc.poll() is None:
            now = time.monotonic()
            if (latest := checkpoint.latest_commit()) != last:
                last, moved = latest, now
            if now > deadline or now - moved > STALL_S:
                self.kill()
                raise RuntimeError(f"the {self.mode} driver's last run did not finish: last commit {last}, "
                                   f"{now - moved:.0f}s without a new one")
            time.sleep(0.5)
        lines = [line for line in self._stdout(self.runs).read_text().splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"the {self.mode} driver's last run exited {proc.returncode} (its log is in the "
                               "run log)")
        result: dict[str, Any] = json.loads(lines[-1])
        return result


# ---- what the checkpoint shows -----------------------------------------------------------------


class Checkpoint:
    """A streaming query's checkpoint as Spark leaves it: `offsets/N` is written (atomically, by rename)
    when micro-batch N is planned, `commits/N` once its output is written. A batch with offsets and no
    commit is the one a restarted query runs again."""

    def __init__(self, path: Path, input_topic: str) -> None:
        self.path, self.input_topic = path, input_topic

    def _batches(self, kind: str) -> list[int]:
        try:
            return sorted(int(p.name) for p in (self.path / kind).iterdir() if p.name.isdigit())
        except FileNotFoundError:
            return []

    def latest_commit(self) -> int:
        """The last micro-batch Spark committed (-1 before the first)."""
        batches = self._batches("commits")
        return batches[-1] if batches else -1

    def committed(self, batch: int) -> bool:
        return (self.path / "commits" / str(batch)).exists()

    def planned_end(self, batch: int) -> int | None:
        """The input offsets (summed over partitions) micro-batch `batch` reads up to; None if not planned.

        The offsets file is "v1", the batch's metadata, then one line per source: Spark's Kafka source and
        reliable_kafka's both write {"topic": {"partition": offset}}.
        """
        try:
            lines = (self.path / "offsets" / str(batch)).read_text().splitlines()
        except FileNotFoundError:
            return None
        for line in lines[2:]:
            offsets = json.loads(line) if line.startswith("{") else {}
            if self.input_topic in offsets:
                return sum(int(o) for o in offsets[self.input_topic].values())
        raise RuntimeError(f"offsets/{batch} of {self.path} names no offsets of {self.input_topic}: {lines!r}")

    def latest_planned_end(self) -> int:
        batches = self._batches("offsets")
        end = self.planned_end(batches[-1]) if batches else None
        return end or 0

    def committed_end(self) -> int:
        """The input offsets (summed) up to which Spark committed output: 0 before the first commit."""
        latest = self.latest_commit()
        return (self.planned_end(latest) or 0) if latest >= 0 else 0


@dataclass(frozen=True)
class Kill:
    batch: int  # the micro-batch in flight at the kill
    written: int  # offsets its output had taken in the output topic when the driver died
    landed: bool  # Spark had not committed it: the restarted driver runs it again


class InFlightGate:
    """The moment a driver kill bites: a micro-batch is mid-write and not committed, input remains.

    Ready when (0) the fault's own condition holds (`_armed`: a subclass's), (1) a micro-batch committed
    since the gate was made, at the driver's restart (so it made progress, and the batch it replayed is
    done), (2) the next batch is planned, (3) input remains beyond it, (4) the output topic
    grew past what it held when the last commit was seen (read after that commit appeared, so all of it is
    output of committed batches or more: growth past it is the planned batch's output) and (5) Spark has not
    committed that batch, looked at last, right before the kill.
    """

    def __init__(self, driver: StreamDriver, checkpoint: Checkpoint, probe: OffsetsProbe, input_topic: str,
                 output_topic: str) -> None:
        self._driver, self._checkpoint, self._probe = driver, checkpoint, probe
        self._input, self._output = input_topic, output_topic
        self._since = checkpoint.latest_commit()  # what the restarted driver found committed
        self._commit = self._since
        self._base = 0
        self.batch = -1

    def _output_total(self) -> int:
        return sum(self._probe.high_watermarks(self._output).values())

    # What a kill that landed does to the batch, for the log.
    LANDED = "not committed: it will be replayed"

    def _armed(self) -> bool:
        """A condition of the fault's own, checked before the batch's (the driver kill has none)."""
        return True

    def _strike(self) -> str:
        """Fire the fault; says what it hit."""
        self._driver.kill()
        return "driver SIGKILLed"

    def ready(self) -> bool:
        if (code := self._driver.exit_code()) is not None:
            raise RuntimeError(f"the {self._driver.mode} driver exited ({code}) before its kill")
        if not self._armed():
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

    def kill(self) -> Kill:
        what = self._strike()
        written = self._output_total() - self._base
        kill = Kill(self.batch, written, landed=not self._checkpoint.committed(self.batch))
        log.info("%s: %s with micro-batch %d in flight (%d output offsets written, %s)", self._driver.mode, what,
                 kill.batch, kill.written, self.LANDED if kill.landed else "committed just before the kill")
        return kill


# ---- the feed ----------------------------------------------------------------------------------


class Feed:
    """The pipeline's input: unique values into `topic` from an acks=all idempotent producer; `acked` is
    what its delivery reports confirmed, the set the output must hold exactly once. Values are padded to
    `value_bytes` (0: as numbered)."""

    def __init__(self, connection: Connection, topic: str, value_bytes: int = 0) -> None:
        self.topic = topic
        self.value_bytes = value_bytes
        self.acked: list[bytes] = []
        self._sent = 0
        self._producer = Producer({**connection, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
        self._lock = threading.Lock()  # one chunk at a time: values numbered on from what was fed

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is None:
            self.acked.append(msg.value())
        else:
            log.warning("feed of %s: a record was not delivered: %s", self.topic, err)

    def feed(self, n: int) -> None:
        with self._lock:
            for i in range(self._sent, self._sent + n):
                value = f"{self.topic}-{i:08d}".ljust(self.value_bytes, "x").encode()
                produce_when_room(self._producer, self.topic, value, on_delivery=self._delivered)
            self._sent += n
            if self._producer.flush(60):
                raise RuntimeError(f"feeding {self.topic}: records still undelivered after 60s")


def fed_topics(cluster: LocalKafkaCluster, name: str, client: str, partitions: int, first_feed: int,
               progress: Progress, at: float, value_bytes: int = 0) -> tuple[str, str, Feed]:
    """A pipeline's input and output topics, and its feed with the first records in the input."""
    input_topic, output_topic = topic_name(name, f"{client}-in"), topic_name(name, client)
    cluster.create_topic(input_topic, partitions)
    cluster.create_topic(output_topic, partitions)
    feed = Feed(cluster.client_config(), input_topic, value_bytes=value_bytes)
    progress(f"{client}: feeding {first_feed} records", at)
    feed.feed(first_feed)
    return input_topic, output_topic, feed


def backlog_feeder(feed: Feed, probe: OffsetsProbe, checkpoint: Checkpoint, top_up: int, *, low: int,
                   max_top_ups: int, name: str) -> Feeder:
    """Tops the input up by `top_up` whenever fewer than `low` records are left beyond the planned batches."""
    return Feeder(lambda: feed.feed(top_up),
                  lambda: sum(probe.end_offsets(feed.topic).values()) - checkpoint.latest_planned_end(),
                  low=low, poll_s=0.5, max_top_ups=max_top_ups, max_seconds=900, name=name)


# ---- the scenario ------------------------------------------------------------------------------


def _pipeline(cluster: LocalKafkaCluster, client: str, mode: str, progress: Progress, at: float) -> ScenarioResult:
    conn = cluster.client_config()
    started = time.monotonic()
    input_topic, output_topic, feed = fed_topics(cluster, NAME, client, PARTITIONS, FIRST_FEED, progress, at)
    with tempfile.TemporaryDirectory(prefix="rk-lab-stream-") as work, OffsetsProbe(conn) as probe:
        driver = StreamDriver(mode, conn, input_topic, output_topic, Path(work))
        checkpoint = Checkpoint(driver.checkpoint, input_topic)
        feeder = backlog_feeder(feed, probe, checkpoint, TOP_UP, low=LOW_WATER, max_top_ups=40,
                                name=f"{NAME}-{client}-feeder")
        try:
            driver.start()
            feeder.start()
            # What was fed is final once the kills are done: the last run reads all of it.
            kills = kills_mid_batch(lambda: InFlightGate(driver, checkpoint, probe, input_topic, output_topic), feeder,
                                    what=f"{client}: driver SIGKILL", attempts=GATE_ATTEMPTS,
                                    timeout_s=GATE_TIMEOUT_S, progress=progress, at=at,
                                    after_each=lambda n: driver.start() if n < KILLS else None)
            progress(f"{client}: last driver run (available now, {len(feed.acked)} records fed)", at + 0.4)
            driver.start(available_now=True)
            last = driver.wait_finished(checkpoint)
        finally:
            driver.kill()
    detail = f"{kills_summary(kills, 'driver SIGKILLs')}; {driver.runs} driver runs, the last read {last['rows']} rows"
    return pipeline_result(NAME, client, conn, feed, output_topic, started, detail)


def kills_mid_batch(gate_for: Callable[[], InFlightGate], feeder: Feeder, *, what: str, attempts: int,
                    timeout_s: float, progress: Progress, at: float, count: int = KILLS,
                    after_each: Callable[[int], object] | None = None) -> list[Kill]:
    """`count` kills, each fired as soon as a fresh gate (`gate_for()`) holds, re-armed by a top-up; then the
    feeder stops, so what was fed is final. `after_each(n)` runs after kill n (a driver's restart)."""
    kills: list[Kill] = []
    try:
        for n in range(1, count + 1):
            gate = gate_for()
            kills.append(fire_when(gate.ready, gate.kill, what=f"{what} {n} of {count}", rearm=feeder.top_up_now,
                                   attempts=attempts, timeout_s=timeout_s, poll_s=0.01))
            progress(f"{what} mid-batch ({n} of {count})", at + 0.4 * n / (count + 1))
            if after_each is not None:
                after_each(n)
    finally:
        feeder.stop()
    return kills


def kills_summary(kills: list[Kill], fault: str) -> str:
    """Where the kills landed, for a result's detail."""
    landed = [k for k in kills if k.landed]
    return (f"{len(kills)} {fault} with a micro-batch mid-write, {len(landed)} before Spark committed it (batches "
            f"{', '.join(str(k.batch) for k in kills)}; {' + '.join(str(k.written) for k in landed) or 0} output "
            "offsets of those batches written when killed)")


def pipeline_result(name: str, client: str, conn: Connection, feed: Feed, output_topic: str, started: float,
                    detail: str) -> ScenarioResult:
    """The independent read_committed count of the output against what the feed got acknowledged; for ours,
    how many records of aborted transactions the read skipped."""
    if client == RELIABLE:
        everything = len(read_back(conn, output_topic, isolation_level="read_uncommitted"))
        committed = len(read_back(conn, output_topic))
        detail += f"; {everything - committed} records of aborted transactions hidden from read_committed"
    return count(name, client, feed.acked, conn, output_topic, started, detail)


def run(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    results = [_pipeline(cluster, CONTROL, CONTROL_MODE, progress, 0.0)]
    results.append(_pipeline(cluster, RELIABLE, RELIABLE_MODE, progress, 0.5))
    progress("done", 1.0)
    return results


SCENARIO = Scenario(
    name=NAME,
    description="L9 Spark streaming driver kill: a Kafka -> Structured Streaming -> Kafka driver is SIGKILLed 3 "
    "times mid-batch and restarted from its checkpoint: Spark's Kafka source and sink duplicate the replayed "
    "batch, reliable_kafka's source and exactly_once sink write each record once",
    run=run,
    needs=("spark",),
)
