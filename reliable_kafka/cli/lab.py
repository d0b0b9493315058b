"""`reliable-kafka lab`: the classic loss scenarios, control client beside reliable_kafka, counted.

Starts (and stops) a local real cluster unless pointed at one that `reliable-kafka cluster start`
runs: the lab injects faults by signalling broker processes, so it cannot use a foreign cluster.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from reliable_kafka.cli.cluster import default_state_file
from reliable_kafka.cli.output import check_writable, console, emit_json, fail, table
from reliable_kafka.errors import ClusterError
from reliable_kafka.lab.base import CONTROL, RELIABLE, ScenarioResult
from reliable_kafka.lab.registry import scenarios
from reliable_kafka.testing.cluster import LocalKafkaCluster

log = logging.getLogger(__name__)


def _cluster_for(bootstrap: str | None, state_file: Path | None, brokers: int) -> tuple[LocalKafkaCluster, bool]:
    """The cluster to break, and whether the lab started it (and so must stop it)."""
    if bootstrap is None:
        return LocalKafkaCluster(brokers=brokers, controllers=3), True
    state = state_file or default_state_file()
    if not state.exists():
        fail(f"the lab injects faults by signalling broker processes, so it needs a cluster started with "
             f"`reliable-kafka cluster start`; no such cluster state at {state} for {bootstrap}")
    cluster = LocalKafkaCluster.attach(state)
    if set(bootstrap.split(",")) & set(cluster.bootstrap_servers.split(",")) == set():
        fail(f"{bootstrap} is not the local cluster in {state} ({cluster.bootstrap_servers}); the lab can only "
             "break a cluster whose broker processes it can signal")
    try:
        cluster.registered_brokers(timeout=10)
    except ClusterError as exc:
        fail(f"brokers at {bootstrap} are unreachable: {exc}")
    return cluster, False


@click.command("lab")
@click.argument("names", nargs=-1, metavar="[SCENARIO ...]")
@click.option("--bootstrap-servers", default=None, help="Use the running `reliable-kafka cluster` at B.")
@click.option("--state-file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--json", "json_path", default=None, metavar="PATH", help="Write the results as JSON ('-' = stdout).")
@click.option("--list", "list_only", is_flag=True, help="List the scenarios and exit.")
def lab(names: tuple[str, ...], bootstrap_servers: str | None, state_file: Path | None, json_path: str | None,
        list_only: bool) -> None:
    """Reproduce the classic Kafka loss scenarios: an unsafe control client loses, reliable_kafka does not."""
    known = scenarios()
    if list_only:
        table("lab scenarios", ["name", "what happens"], [[s.name, s.description] for s in known.values()])
        return
    unknown = [n for n in names if n not in known]
    if unknown:
        fail(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(known)}", code=2)
    chosen = [known[n] for n in names] if names else list(known.values())
    check_writable(json_path)
    needs_five = any("5-node cluster" in s.needs for s in chosen)
    cluster, owned = _cluster_for(bootstrap_servers, state_file, 5 if needs_five else 3)
    if needs_five and max(len(cluster.nodes), cluster.brokers if owned else 0) < 5:
        fail("unclean-election needs 5 nodes (3 controllers + 2 broker-only): run the lab without "
             "--bootstrap-servers, or `reliable-kafka cluster start --brokers 5`")
    results: list[ScenarioResult] = []
    started = time.monotonic()
    try:
        if owned:
            console.print(f"starting a local Kafka cluster ({len(cluster.nodes) or cluster.brokers} nodes)...")
            cluster.start()
            cluster.wait_healthy()
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[step]}"),
                      TimeElapsedColumn(), console=console, transient=False) as bar:
            for s in chosen:
                task = bar.add_task(s.name, total=1.0, step="")

                def progress(step: str, fraction: float, task: TaskID = task) -> None:
                    bar.update(task, completed=min(1.0, fraction), step=step)

                try:
                    results += s.run(cluster, progress)
                except Exception as exc:  # one broken scenario must not hide the others' results
                    log.exception("scenario %s failed", s.name)
                    bar.update(task, step=f"[red]failed: {exc}")
                    results.append(ScenarioResult(s.name, RELIABLE, 0, 0, -1, -1, -1, 0.0, f"scenario error: {exc}"))
                    cluster.heal()
                else:
                    bar.update(task, completed=1.0, step="done")
    except ClusterError as exc:
        fail(str(exc))
    finally:
        if owned:
            cluster.stop()
    rows = [[r.name, r.client, r.acked, r.consumed_unique, r.lost, r.duplicates, r.duplicates_after_dedup,
             f"{r.seconds:.1f}", r.detail] for r in results]
    table(f"loss lab ({time.monotonic() - started:.0f}s)",
          ["scenario", "client", "acked", "consumed", "lost", "duplicates", "dups after dedup", "s", "detail"], rows)
    if json_path is not None:
        emit_json({"scenarios": [r.as_json() for r in results]}, json_path)
    ours_bad = [r for r in results if r.client == RELIABLE and (r.lost != 0 or r.duplicates_after_dedup != 0)]
    toothless = {r.name for r in results if r.client == CONTROL and r.lost == 0 and r.duplicates == 0}
    for name in sorted(toothless):
        console.print(f"[yellow]note:[/] the control client lost and duplicated nothing in {name}: "
                      "the fault did not bite this time")
    if ours_bad:
        fail("reliable_kafka lost or duplicated messages in: " + ", ".join(sorted({r.name for r in ours_bad})))


__all__ = ["lab"]
