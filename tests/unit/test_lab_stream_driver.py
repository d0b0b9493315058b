"""The `spark-stream-driver-kill` lab's machinery without Kafka or Spark: the scenario is listed (it needs the
spark extra), its driver program refuses what cannot run, the gate reads Spark's checkpoint layout, and a
killed driver's session leaves no process behind. The scenario itself runs in the lab, on a real cluster
(docs/results.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reliable_kafka.lab.programs.stream_driver_proc import parse_args
from reliable_kafka.lab.registry import scenarios
from reliable_kafka.lab.spark_stream_driver_kill import Checkpoint, kill_session, session_members

ARGS = ["--mode", "reliable", "--input", "in", "--output", "out", "--checkpoint", "/cp"]


def test_the_scenario_is_listed_and_needs_spark() -> None:
    scenario = scenarios()["spark-stream-driver-kill"]
    assert scenario.needs == ("spark",)
    assert scenario.description.startswith("L9 ") and "driver" in scenario.description


def test_the_driver_program_takes_its_arguments() -> None:
    args = parse_args([*ARGS, "--max-offsets-per-trigger", "500", "--available-now"])
    assert (args.mode, args.input, args.output, args.checkpoint) == ("reliable", "in", "out", "/cp")
    assert (args.max_offsets_per_trigger, args.available_now, args.max_seconds) == (500, True, 600.0)
    assert parse_args(ARGS).available_now is False


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--output", "in"], "would read what it wrote"),
        (["--max-offsets-per-trigger", "0"], "--max-offsets-per-trigger must be >= 1"),
        (["--max-seconds", "0"], "--max-seconds must be > 0"),
        (["--mode", "at_most_once"], "invalid choice"),
    ],
)
def test_the_driver_program_refuses_what_cannot_run(extra: list[str], said: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args([*ARGS, *extra])
    assert exited.value.code == 2
    assert said in capsys.readouterr().err


def _batch_file(directory: Path, batch: int, text: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / str(batch)).write_text(text)
    # What Spark leaves beside its log files: checksums and files being written, never read as batches.
    (directory / f".{batch}.crc").write_text("crc")
    (directory / f".{batch + 1}.0b7c.tmp").write_text("half")


def test_the_gate_reads_what_spark_planned_and_committed(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, "lab-in")
    assert (checkpoint.latest_commit(), checkpoint.latest_planned_end(), checkpoint.planned_end(0)) == (-1, 0, None)
    meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1, "conf": {}})
    _batch_file(tmp_path / "offsets", 0, f'v1\n{meta}\n{{"lab-in":{{"1":500,"0":500}}}}')
    _batch_file(tmp_path / "offsets", 1, f'v1\n{meta}\n{{"lab-in":{{"0":1000,"1":1000}}}}')
    _batch_file(tmp_path / "commits", 0, 'v1\n{"nextBatchWatermarkMs":0}')
    assert checkpoint.latest_commit() == 0
    assert checkpoint.committed(0) and not checkpoint.committed(1)
    assert (checkpoint.planned_end(0), checkpoint.planned_end(1), checkpoint.latest_planned_end()) == (1000, 2000, 2000)
    assert checkpoint.planned_end(2) is None
    # Another query's offsets file is not read as this one's.
    _batch_file(tmp_path / "offsets", 2, f'v1\n{meta}\n{{"other":{{"0":7}}}}')
    with pytest.raises(RuntimeError, match="names no offsets of lab-in"):
        checkpoint.planned_end(2)


def test_a_killed_session_leaves_no_process_behind() -> None:
    # A child in a session of its own starts a grandchild that leaves its process group, as pyspark's worker
    # daemon does (setpgid): a process group kill alone would leave it running.
    code = ("import os, subprocess, sys, time\n"
            "g = subprocess.Popen([sys.executable, '-c', 'import os, time; os.setpgid(0, 0); time.sleep(60)'])\n"
            "print(g.pid, flush=True)\n"
            "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    try:
        assert sorted(session_members(proc.pid)) == sorted([proc.pid, grandchild])
        kill_session(proc, timeout_s=10)
        assert session_members(proc.pid) == []
        assert proc.returncode == -9
    finally:
        if proc.poll() is None:
            kill_session(proc, timeout_s=10)
        proc.stdout.close()
