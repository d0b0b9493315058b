"""The command line's output contract: results on stdout (JSON alone when `--json -`), progress and
chatter elsewhere, plain tables that cut nothing, and lab verdicts and exit codes that are true."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reliable_kafka.cli import lab as lab_cli
from reliable_kafka.cli.main import cli
from reliable_kafka.cli.output import plain_table
from reliable_kafka.cli.runlog import chatter_to_file
from reliable_kafka.lab.base import CONTROL, RELIABLE, ScenarioResult


def _result(name: str, client: str, lost: int = 0, dups: int = 0, after: int = 0) -> ScenarioResult:
    return ScenarioResult(name, client, 100, 100 - lost, lost, dups, after, 1.0)


def test_a_plain_table_pads_every_column_and_cuts_nothing() -> None:
    long = "leader-hard-bounce-with-a-very-long-name-that-rich-would-squeeze"
    text = plain_table("lab", ["scenario", "lost"], [[long, "0"], ["x", "12345"]])
    lines = text.splitlines()
    assert lines[0] == "lab"
    assert long in text and "12345" in text
    assert lines[1].index("lost") == lines[3].index("0") == len(long) + 2


def test_lab_verdict_exit_codes() -> None:
    bit = [_result("a", CONTROL, lost=5), _result("a", RELIABLE)]
    assert lab_cli.verdict(bit, set()) == (0, [])
    # reliable_kafka lost something: 1, whatever else happened
    code, notes = lab_cli.verdict([_result("a", CONTROL), _result("a", RELIABLE, lost=1)], set())
    assert code == 1 and "lost or duplicated messages in: a" in notes[-1]
    # duplicates that dedup by rk-id removes are not ours to answer for; ones it cannot remove are
    assert lab_cli.verdict([_result("a", CONTROL, dups=3), _result("a", RELIABLE, dups=2, after=0)], set())[0] == 0
    assert lab_cli.verdict([_result("a", CONTROL, dups=3), _result("a", RELIABLE, dups=2, after=2)], set())[0] == 1
    # a control that did not bite, or a scenario with no verdict: the run proves nothing there (3)
    code, notes = lab_cli.verdict([_result("a", CONTROL), _result("a", RELIABLE)], set())
    assert code == 3 and "did not bite" in notes[0]
    code, notes = lab_cli.verdict(bit, {"b"})
    assert code == 3 and "b gave no verdict" in notes[0]


def test_a_lab_scenario_whose_extra_is_missing_is_skipped_not_a_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lab_cli, "missing_modules", lambda extra: ["pyspark"] if extra == "spark" else [])

    def no_cluster(*args: object) -> None:
        raise AssertionError("a run of skipped scenarios only must not start a cluster")

    monkeypatch.setattr(lab_cli, "_cluster_for", no_cluster)
    result = CliRunner().invoke(cli, ["lab", "spark-task-retry", "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # stdout carries the JSON alone: the table went to stderr
    assert data["skipped"] == {"spark-task-retry": "needs pyspark: pip install 'reliable-kafka[spark]'"}
    assert data["scenarios"] == [] and data["exit_code"] == 0
    assert "skipped (needs pyspark: pip install 'reliable-kafka[spark]')" in result.stderr


def test_bench_plot_without_the_plot_extra_is_refused_before_any_run(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    from reliable_kafka.cli import bench as bench_cli

    monkeypatch.setattr(bench_cli, "missing_modules", lambda extra: ["matplotlib"] if extra == "plot" else [])
    monkeypatch.setattr(bench_cli, "LocalKafkaCluster", None)  # any run would need it: none may start
    result = CliRunner().invoke(cli, ["bench", "producer", "--plot", str(tmp_path / "p.png")])
    assert result.exit_code == 2
    assert "pip install 'reliable-kafka[plot]'" in result.output


def test_bench_redraws_the_plot_and_table_of_earlier_runs_from_their_json(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    from reliable_kafka.cli import bench as bench_cli

    monkeypatch.setattr(bench_cli, "LocalKafkaCluster", None)  # nothing is measured: no cluster may start
    runs = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "services"
    png = tmp_path / "bench.png"
    result = CliRunner().invoke(cli, ["bench", "--from-json", str(runs / "producer-calls.json"),
                                      "--from-json", str(runs / "consumer.json"), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "send-threads-16-process" in result.output and "aio_reliable" in result.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 900 and height >= 60 * 10, (width, height)  # a row of room per bar: no label overlaps
    (tmp_path / "not-bench.json").write_text('{"scenarios": []}')
    refused = CliRunner().invoke(cli, ["bench", "--from-json", str(tmp_path / "not-bench.json")])
    assert refused.exit_code == 2 and "not the JSON of `reliable-kafka bench --json`" in refused.output


def test_log_records_of_a_run_go_to_its_log_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RK_RUNS_DIR", str(tmp_path))
    with chatter_to_file("lab", verbose=0) as path:
        logging.getLogger("reliable_kafka.rdkafka").warning("FAIL broker down")
    assert path is not None and path.parent.parent == tmp_path
    assert "FAIL broker down" in path.read_text()
    err = capsys.readouterr().err
    assert "FAIL broker down" not in err and str(path) in err  # the path once, not the chatter
    with chatter_to_file("lab", verbose=1) as none:
        assert none is None  # -v: nothing redirected


def test_raw_librdkafka_lines_on_descriptor_2_go_to_the_log_file(tmp_path: Path) -> None:
    # librdkafka clients without a logger write straight to descriptor 2: only a redirect of it catches them.
    program = (
        "import os, sys\n"
        "from reliable_kafka.cli.runlog import chatter_to_file\n"
        "with chatter_to_file('lab', verbose=0) as path:\n"
        "    os.write(2, b'%3|1.0|FAIL|rdkafka#producer-1| broker down\\n')\n"
        "    print('progress', file=sys.stderr)\n"
        "print('after', file=sys.stderr)\n"
        "print(path)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          env={"RK_RUNS_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}, check=True)
    path = Path(done.stdout.strip())
    assert "|FAIL|" in path.read_text()
    assert "|FAIL|" not in done.stderr
    assert "progress" in done.stderr and "after" in done.stderr and str(path) in done.stderr
