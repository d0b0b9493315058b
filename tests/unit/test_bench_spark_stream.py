"""`reliable-kafka bench spark-stream` is offered, refuses what it cannot run before any cluster starts, and
refuses a run whose output does not hold the input's rows (no figure from a run that lost or duplicated)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from reliable_kafka.bench.common import BenchRow, target_of
from reliable_kafka.cli.main import cli


def test_spark_stream_is_offered_and_bad_input_is_refused_before_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from reliable_kafka.cli import bench as bench_cli

    monkeypatch.setattr(bench_cli, "LocalKafkaCluster", None)  # any run would need it: none may start
    runner = CliRunner()
    assert "spark-stream" in runner.invoke(cli, ["bench", "--help"]).output
    few = runner.invoke(cli, ["bench", "spark-stream", "--messages", "10"])
    assert few.exit_code == 2 and "--messages" in few.output
    rounds = runner.invoke(cli, ["bench", "spark-stream", "--repeat", "0"])
    assert rounds.exit_code == 2 and "--repeat" in rounds.output
    other = runner.invoke(cli, ["bench", "producer", "--max-offsets-per-trigger", "5000"])
    assert other.exit_code == 2 and "an option of bench spark-stream" in other.output
    monkeypatch.setattr(bench_cli, "missing_modules", lambda extra: ["pyspark"] if extra == "spark" else [])
    no_spark = runner.invoke(cli, ["bench", "spark-stream"])
    assert no_spark.exit_code == 2 and "pip install 'reliable-kafka[spark]'" in no_spark.output


def test_the_targets_are_against_spark_s_own_source_and_sink() -> None:
    def row(variant: str) -> BenchRow:
        return BenchRow("spark-stream", variant, 1_000_000, 1.0, "spark_kafka_source_sink", 1.0, 1.0)

    assert (target_of(row("at_least_once")), target_of(row("exactly_once"))) == (1.0, 0.5)
    assert target_of(row("spark_kafka_source_sink_batched")) is None  # context, no target


def test_a_run_that_lost_or_duplicated_rows_is_not_a_measurement() -> None:
    pytest.importorskip("pyspark")
    from reliable_kafka.bench.spark_stream import check_delivered

    check_delivered("exactly_once", 1_000, 1_000, "out")
    with pytest.raises(RuntimeError, match="999 records to out, not 1,000 \\(1 lost\\)"):
        check_delivered("exactly_once", 1_000, 999, "out")
    with pytest.raises(RuntimeError, match="\\(24 duplicated\\)"):
        check_delivered("spark_kafka_source_sink", 1_000, 1_024, "out")
