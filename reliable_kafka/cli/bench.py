"""`reliable-kafka bench`: what the guarantees cost, as ratios against a baseline in the same run.

Uses the brokers given (--bootstrap-servers, --config, -X), else the running `reliable-kafka cluster`, else
starts (and stops) a local real cluster; writes a table, optional JSON (`{"benchmarks": [...]}`) and an
optional PNG of each ratio against its target.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from reliable_kafka.admin import admin_client
from reliable_kafka.bench.common import SHORT_RUN_S, BenchRow, Connection, run_facts, target_of
from reliable_kafka.bench.suites import consumer_bench, dedup_bench, producer_bench, producer_calls_bench
from reliable_kafka.cli.connection import connection_config, connection_options, redact, running_cluster
from reliable_kafka.cli.output import check_writable, console, emit_json, fail, table
from reliable_kafka.cli.runlog import chatter_to_file
from reliable_kafka.errors import ClusterError, ReliableKafkaError
from reliable_kafka.extras import missing_modules, needs_extra
from reliable_kafka.testing.cluster import LocalKafkaCluster

log = logging.getLogger(__name__)

BENCHES = ("producer", "producer-calls", "consumer", "eos", "dedup", "spark", "spark-stream")
SPARK_BENCHES = ("spark", "spark-stream")


def _create_topic_fn(connection: Connection) -> Callable[[str, int], None]:
    from confluent_kafka.admin import NewTopic

    admin = admin_client(connection["bootstrap.servers"], connection)

    def create(name: str, partitions: int) -> None:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=3,
                                      config={"min.insync.replicas": "2"})])[name].result(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            t = admin.list_topics(name, timeout=5).topics.get(name)
            if t is not None and t.error is None and all(p.leader >= 0 for p in t.partitions.values()):
                return
            time.sleep(0.2)

    return create


def _external(module: str, function: str, *args: Any, **kwargs: Any) -> list[BenchRow]:
    """The eos, spark and spark-stream suites return plain dict rows; they need optional parts."""
    fn = getattr(importlib.import_module(module), function)
    return [BenchRow.from_json(r) for r in fn(*args, **kwargs)]


def plot(rows: list[BenchRow], path: str) -> None:
    """A horizontal bar per variant (labels never overlap), its ratio written at the bar's end, the
    target as a tick on the bar's row, the baseline named in the label."""
    with needs_extra("plot", "bench --plot"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    shown = [r for r in rows if r.variant != r.baseline]
    labels = [f"{r.name}: {r.variant}\nvs {r.baseline}" for r in shown]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(shown) + 1.5))
    ys = range(len(shown))
    targets = [target_of(r) for r in shown]
    colors = ["tab:grey" if target is None  # a reference row, no target
              else "tab:green" if r.ratio_vs_baseline >= target else "tab:red"
              for r, target in zip(shown, targets, strict=True)]
    ax.barh(ys, [r.ratio_vs_baseline for r in shown], color=colors, height=0.6)
    for y, r, target in zip(ys, shown, targets, strict=True):
        if target is not None:
            ax.vlines(target, y - 0.4, y + 0.4, colors="black", linestyles="dashed")
        ax.text(r.ratio_vs_baseline + 0.02, y, f"{r.ratio_vs_baseline:.2f}×", va="center", fontsize=8)
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlim(0, max([1.1, *(r.ratio_vs_baseline + 0.15 for r in shown)]))
    ax.set_xlabel("throughput vs its baseline in the same run (1.0 = as fast)")
    ax.set_title("reliable-kafka benchmarks\ndashed tick: target; green: met, red: missed, grey: reference",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _results_table(title: str, rows: list[BenchRow], *, to_stderr: bool) -> None:
    """One row per variant: its median and spread, its baseline, its ratio and target, its peak RSS."""
    table(title,
          ["benchmark", "variant", "messages", "msgs/s", "min–max", "baseline", "ratio", "ratio min–max", "target",
           "peak RSS MB"],
          [[r.name, r.variant, r.messages, f"{r.msgs_per_s:,.0f}",
            f"{min(r.runs):,.0f}–{max(r.runs):,.0f}" if r.runs else "", r.baseline, f"{r.ratio_vs_baseline:.2f}",
            "" if r.ratio_min is None or r.ratio_max is None else f"{r.ratio_min:.2f}–{r.ratio_max:.2f}",
            "" if target_of(r) is None else f"≥ {target_of(r)}",
            f"{r.peak_rss_mb:.0f}"] for r in rows], to_stderr=to_stderr)


def _redraw(paths: tuple[str, ...], plot_path: str | None) -> None:
    """The table (and the plot) of earlier runs, from their JSON: a chart is redrawn without re-measuring."""
    rows: list[BenchRow] = []
    for path in paths:
        try:
            rows += [BenchRow.from_json(r) for r in json.loads(Path(path).read_text())["benchmarks"]]
        except (ValueError, KeyError, TypeError) as exc:
            fail(f"{path} is not the JSON of `reliable-kafka bench --json`: {exc!r}", code=2)
    if not rows:
        fail("no benchmark rows in " + ", ".join(paths), code=2)
    _results_table("benchmarks (from " + ", ".join(paths) + ")", rows, to_stderr=False)
    if plot_path is not None:
        plot(rows, plot_path)


def _group_commit_table(rows: list[BenchRow], *, to_stderr: bool) -> None:
    """What only some rows measure: how many messages an outbox transaction carried (producer-calls: group
    commit), and the worst event-loop stall of the asyncio runs (producer-calls, consumer)."""
    shown = [r for r in rows if "msgs_per_commit" in r.extra or "loop_stall_max_ms" in r.extra]
    if not shown:
        return
    table("messages per outbox transaction (per-message sends), worst event-loop stall of asyncio runs "
          "(over all rounds)",
          ["benchmark", "variant", "msgs per commit (median)", "worst loop stall ms"],
          [[r.name, r.variant, "" if "msgs_per_commit" not in r.extra else f"{r.extra['msgs_per_commit']:,.1f}",
            "" if "loop_stall_max_ms" not in r.extra else f"{r.extra['loop_stall_max_ms']:,.1f}"] for r in shown],
          to_stderr=to_stderr)


def _brokers(conf: dict[str, Any]) -> tuple[LocalKafkaCluster | None, bool]:
    """Fill in conf's bootstrap.servers when none was given; the cluster the bench started (to stop it), and
    whether the brokers are a local cluster of ours (their Kafka version is then known).

    A running `reliable-kafka cluster` is used rather than a second one started beside it.
    """
    if "bootstrap.servers" not in conf:
        running = running_cluster()
        if running is not None:
            conf.update({**running.client_config(), **conf})  # a secured one: as its super user
            console.print(f"using the running local cluster at {running.bootstrap_servers}"
                          + (f" ({running.security})" if running.security else ""))
        else:
            cluster = LocalKafkaCluster(brokers=3)
            console.print("starting a local Kafka cluster (3 nodes)...")
            try:
                cluster.start()
                cluster.wait_healthy()
            except ClusterError as exc:
                fail(str(exc))
            conf["bootstrap.servers"] = cluster.bootstrap_servers
            return cluster, True
        local = True
    else:
        local = False
    try:
        admin_client(conf["bootstrap.servers"], conf).list_topics(timeout=10)
    except Exception as exc:
        fail(f"brokers at {conf['bootstrap.servers']} are unreachable: {redact(str(exc), conf)}")
    return None, local


@click.command("bench")
@click.argument("which", type=click.Choice([*BENCHES, "all"]), default="all")
@click.option("--messages", type=click.IntRange(min=1000), default=None,
              help="Messages per variant (default: 1,000,000; spark rows and spark-stream records: the same).")
@connection_options("Benchmark against these brokers (default: the running `reliable-kafka cluster`, else a "
                    "local cluster started for the run).")
@click.option("--repeat", type=click.IntRange(1, 9), default=3, show_default=True,
              help="Interleaved rounds (A B C, A B C, ...) after a warm-up; each variant's median is reported, "
                   "with its spread and every run in the JSON.")
@click.option("--max-offsets-per-trigger", "max_offsets_per_trigger", type=click.IntRange(min=1000), default=None,
              metavar="N", help="spark-stream: every variant's maxOffsetsPerTrigger (default: 100,000).")
@click.option("--json", "json_path", default=None, metavar="PATH")
@click.option("--plot", "plot_path", default=None, metavar="PATH", help="Write a PNG chart of the ratios.")
@click.option("--from-json", "from_json", multiple=True, type=click.Path(exists=True, dir_okay=False),
              metavar="PATH", help="Run nothing: draw --plot (and the table) from the rows of earlier --json files.")
def bench(which: str, messages: int | None, bootstrap_servers: str | None, config_file: Path | None,
          overrides: tuple[str, ...], repeat: int, max_offsets_per_trigger: int | None, json_path: str | None,
          plot_path: str | None, from_json: tuple[str, ...]) -> None:
    """Measure producer, producer-calls, consumer, eos, dedup, spark and spark-stream variants against their
    baselines (spark-stream: Structured Streaming Kafka to Kafka, our source and sink against Spark's own)."""
    check_writable(json_path)
    check_writable(plot_path)
    if plot_path is not None and missing_modules("plot"):
        # Said before the runs, not after minutes of benchmarking.
        raise click.UsageError("--plot needs the plot extra (matplotlib): pip install 'reliable-kafka[plot]'")
    if from_json:
        _redraw(from_json, plot_path)
        return
    if max_offsets_per_trigger is not None and which not in ("spark-stream", "all"):
        raise click.UsageError("--max-offsets-per-trigger is an option of bench spark-stream")
    if which in SPARK_BENCHES and missing_modules("spark"):
        # Said before a cluster starts; `all` goes on without them (each says it failed, and why).
        raise click.UsageError(f"bench {which} needs the spark extra ({missing_modules('spark')[0]}): "
                               "pip install 'reliable-kafka[spark]'")
    conf = connection_config(bootstrap_servers, config_file, overrides) or {}
    n = messages or 1_000_000
    chosen = list(BENCHES) if which == "all" else [which]
    load_before = os.getloadavg()
    with chatter_to_file("bench"):
        cluster, local = _brokers(conf)
        rows: list[BenchRow] = []
        create = _create_topic_fn(conf)
        try:
            with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                          console=console) as bar:
                task = bar.add_task("benchmarks", total=None)

                def progress(step: str) -> None:
                    bar.update(task, description=step)

                for b in chosen:
                    try:
                        if b == "producer":
                            rows += producer_bench(conf, create, n, progress, repeat)
                        elif b == "producer-calls":
                            rows += producer_calls_bench(conf, create, n, progress, repeat)
                        elif b == "consumer":
                            rows += consumer_bench(conf, create, n, progress, repeat)
                        elif b == "dedup":
                            rows += dedup_bench(conf, create, n, progress, repeat)
                        elif b == "eos":
                            progress("eos")
                            rows += _external("reliable_kafka.bench.eos", "run_eos_bench", conf, n, create,
                                              repeat=repeat)
                        elif b == "spark":
                            progress("spark")
                            rows += _external("reliable_kafka.bench.spark", "run_spark_bench", conf, n, create,
                                              rounds=repeat)
                        elif b == "spark-stream":
                            progress("spark-stream")
                            rows += _external("reliable_kafka.bench.spark_stream", "run_spark_stream_bench", conf,
                                              n, create, rounds=repeat,
                                              **({} if max_offsets_per_trigger is None
                                                 else {"max_offsets_per_trigger": max_offsets_per_trigger}))
                    except (ReliableKafkaError, RuntimeError, ModuleNotFoundError) as exc:
                        # A worker's stderr or a client's error may quote a setting: never a secret.
                        why = redact(str(exc), conf)
                        log.error("benchmark %s failed: %s", b, why)
                        console.print(f"[red]benchmark {b} failed:[/] {escape(why)}")
            nodes = len(admin_client(conf["bootstrap.servers"], conf).list_topics(timeout=10).brokers)
        finally:
            if cluster is not None:
                cluster.stop()
    _results_table(f"benchmarks: median of {repeat} interleaved round(s), ratios against a baseline in the same run",
                   rows, to_stderr=json_path == "-")
    _group_commit_table(rows, to_stderr=json_path == "-")
    short = [f"{r.name}/{r.variant} {r.shortest_run_s:.1f} s" for r in rows if r.short]
    if short:
        console.print(f"[yellow]note:[/] {len(short)} variant(s) ran under {SHORT_RUN_S:.0f} s at their fastest "
                      f"({', '.join(short)}): their ratios are mostly noise; use more --messages")
    if json_path is not None:
        emit_json({"benchmarks": [r.as_json() for r in rows],
                   "run": run_facts(messages=n, repeat=repeat, nodes=nodes, load_before=load_before,
                                          local_cluster=local)}, json_path)
    if plot_path is not None and rows:
        plot(rows, plot_path)
    if not rows:
        fail("no benchmark produced a result")
