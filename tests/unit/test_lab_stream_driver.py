"""The machinery of the `spark-stream-driver-kill` and `spark-stream-executor-kill` labs without Kafka or Spark:
the scenarios are listed (they need the spark extra), their driver program refuses what cannot run, a cluster
driver's settings ship the package, the gates read Spark's checkpoint layout, and a killed driver's session
leaves no process behind. The scenarios themselves run in the lab, on real clusters (docs/results.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from reliable_kafka.lab.programs.stream_driver_proc import parse_args
from reliable_kafka.lab.registry import scenarios
from reliable_kafka.lab.spark_stream_driver_kill import Checkpoint, kill_session, session_members
from reliable_kafka.testing.spark_cluster import driver_conf, package_zip

ARGS = ["--mode", "reliable", "--input", "in", "--output", "out", "--checkpoint", "/cp"]


def test_the_scenarios_are_listed_and_need_spark() -> None:
    scenario = scenarios()["spark-stream-driver-kill"]
    assert scenario.needs == ("spark",)
    assert scenario.description.startswith("L9 ") and "driver" in scenario.description
    on_a_cluster = scenarios()["spark-stream-executor-kill"]
    assert on_a_cluster.needs == ("spark",)
    assert on_a_cluster.description.startswith("L9 ") and "executors SIGKILLed" in on_a_cluster.description


def test_a_cluster_driver_ships_the_package_and_keeps_its_temp_files_in_its_directory(tmp_path: Path) -> None:
    zipped = package_zip(tmp_path)
    with zipfile.ZipFile(zipped) as archive:
        names = archive.namelist()
    assert "reliable_kafka/__init__.py" in names and "reliable_kafka/spark/writer.py" in names
    conf = driver_conf("spark://127.0.0.1:7077", zipped, jvm_options=["-XX:TieredStopAtLevel=1"], tmpdir=tmp_path)
    assert (conf["spark.master"], conf["spark.submit.pyFiles"]) == ("spark://127.0.0.1:7077", str(zipped))
    assert conf["spark.driver.bindAddress"] == "127.0.0.1" and conf["spark.ui.enabled"] == "false"
    # A SIGKILLed executor runs no shutdown hook: its native libraries stay where java.io.tmpdir points.
    java = f"-XX:TieredStopAtLevel=1 -Djava.io.tmpdir={tmp_path}"
    assert conf["spark.driver.extraJavaOptions"] == conf["spark.executor.extraJavaOptions"] == java
    with_ui = driver_conf("spark://127.0.0.1:7077", zipped, ui_port=4999)
    assert (with_ui["spark.ui.enabled"], with_ui["spark.ui.port"]) == ("true", "4999")
    assert "spark.executor.extraJavaOptions" not in with_ui


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
        (["--master", "spark://127.0.0.1:7077"], "--master and --py-files go together"),
        (["--py-files", "rk.zip"], "--master and --py-files go together"),
        (["--slow-seconds-per-batch", "-1"], "--slow-seconds-per-batch must be >= 0"),
        (["--stop-file", "stop", "--available-now"], "two ways to end the query"),
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
    assert checkpoint.committed_end() == 0
    meta = json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1, "conf": {}})
    _batch_file(tmp_path / "offsets", 0, f'v1\n{meta}\n{{"lab-in":{{"1":500,"0":500}}}}')
    _batch_file(tmp_path / "offsets", 1, f'v1\n{meta}\n{{"lab-in":{{"0":1000,"1":1000}}}}')
    _batch_file(tmp_path / "commits", 0, 'v1\n{"nextBatchWatermarkMs":0}')
    assert checkpoint.latest_commit() == 0
    assert checkpoint.committed(0) and not checkpoint.committed(1)
    assert (checkpoint.planned_end(0), checkpoint.planned_end(1), checkpoint.latest_planned_end()) == (1000, 2000, 2000)
    assert checkpoint.planned_end(2) is None
    assert checkpoint.committed_end() == 1000
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
