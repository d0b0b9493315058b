"""`reliable-kafka lab`: the classic loss scenarios, control client beside reliable_kafka, counted.

Uses the running `reliable-kafka cluster` (or the one --bootstrap-servers names), else starts (and stops)
a local real cluster: the lab injects faults by signalling broker processes, so it cannot use a foreign
cluster. Every client of a run, controls included, connects with that cluster's own settings
(`client_config()`: on a secured cluster, its super user's login from the state), never with others.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Collection
from pathlib import Path

import click
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from reliable_kafka.cli.cluster import default_state_file
from reliable_kafka.cli.connection import (
    connection_config,
    connection_options,
    hide_secrets_in_client_logs,
    running_cluster,
)
from reliable_kafka.cli.output import check_writable, console, emit_json, fail, table
from reliable_kafka.cli.runlog import chatter_to_file
from reliable_kafka.errors import ClusterError
from reliable_kafka.extras import EXTRAS, missing_modules
from reliable_kafka.lab.base import CONTROL, RELIABLE, Scenario, ScenarioResult
from reliable_kafka.lab.registry import scenarios
from reliable_kafka.testing.cluster import LocalKafkaCluster

log = logging.getLogger(__name__)


def unused_settings(given: dict[str, str] | None, cluster: LocalKafkaCluster) -> list[str]:
    """The keys of `given` (--config, -X) that differ from the cluster's own client settings: refused, not ignored.

    The lab's clients log in with the cluster's own settings (its super user's, restored from the state
    of `reliable-kafka cluster start`), so a setting is accepted only when it says the same, as the
    cluster's own properties file does; any other login or tuning would be used by no client. Keys only,
    never values: they may be secrets.
    """
    own = {k: str(v) for k, v in cluster.client_config().items()}
    return sorted(k for k, v in (given or {}).items() if k != "bootstrap.servers" and own.get(k) != v)


def _cluster_for(given: dict[str, str] | None, state_file: Path | None,
                 brokers: int) -> tuple[LocalKafkaCluster, bool]:
    """The cluster to break, and whether the lab started it (and so must stop it).

    Without --bootstrap-servers a running `reliable-kafka cluster` is used: a second cluster beside it
    would halve what each gets of the host's cores and memory. `given` (--config, -X) must agree with the
    cluster's own settings (see unused_settings), checked before the brokers are asked anything.
    """
    bootstrap = None if given is None else given.get("bootstrap.servers")
    if bootstrap is None:
        running = running_cluster(state_file)
        if running is None:
            cluster = LocalKafkaCluster(brokers=brokers, controllers=3)
            _refuse_unused(given, cluster)
            return cluster, True
        bootstrap = running.bootstrap_servers
        console.print(f"using the running local cluster at {bootstrap}"
                      + (f" ({running.security}, as its super user)" if running.security else ""))
    state = state_file or default_state_file()
    if not state.exists():
        fail(f"the lab injects faults by signalling broker processes, so it needs a cluster started with "
             f"`reliable-kafka cluster start`; no such cluster state at {state} for {bootstrap}", code=NO_CLUSTER)
    cluster = LocalKafkaCluster.attach(state)
    if set(bootstrap.split(",")) & set(cluster.bootstrap_servers.split(",")) == set():
        fail(f"{bootstrap} is not the local cluster in {state} ({cluster.bootstrap_servers}); the lab can only "
             "break a cluster whose broker processes it can signal", code=NO_CLUSTER)
    _refuse_unused(given, cluster)
    try:
        cluster.registered_brokers(timeout=10)
    except ClusterError as exc:
        fail(f"brokers at {bootstrap} are unreachable: {exc}", code=NO_CLUSTER)
    return cluster, False


def _refuse_unused(given: dict[str, str] | None, cluster: LocalKafkaCluster) -> None:
    refused = unused_settings(given, cluster)
    if refused:
        own = "its super user's, from the state" if cluster.security else "an open cluster's: no login"
        fail(f"the lab's clients connect with the cluster's own settings ({own}); {', '.join(refused)} "
             f"{'differs' if len(refused) == 1 else 'differ'} from them and would be used by no client: "
             "drop --config/-X, or give the cluster's own settings file (the --config `cluster start` printed)",
             code=2)


# Exit codes, documented in docs/cli.md#lab: the lab's value is that its verdicts are true. A cluster that
# could not be started or reached has its own code, so that 1 means only "reliable_kafka lost something".
OK, OURS_LOST, NO_PROOF, NO_CLUSTER = 0, 1, 3, 4


def verdict(results: list[ScenarioResult], errored: Collection[str]) -> tuple[int, list[str]]:
    """The exit code and what to say: 1 if reliable_kafka lost or duplicated anything (after dedup);
    else 3 if a scenario gave no verdict or its control lost and duplicated nothing (the run proves
    nothing there); else 0."""
    ours_bad = sorted({r.name for r in results if r.client == RELIABLE and r.name not in errored
                       and (r.lost != 0 or r.duplicates_after_dedup != 0)})
    toothless = sorted({r.name for r in results if r.client == CONTROL and r.lost == 0 and r.duplicates == 0})
    notes = [f"the control client lost and duplicated nothing in {n}: the fault did not bite, so this run "
             "proves nothing there" for n in toothless]
    notes += [f"{n} gave no verdict (scenario error, see the log)" for n in sorted(errored)]
    if ours_bad:
        return OURS_LOST, notes + ["reliable_kafka lost or duplicated messages in: " + ", ".join(ours_bad)]
    return (NO_PROOF if toothless or errored else OK), notes


def missing_part(s: Scenario) -> str | None:
    """Why `s` cannot run in this install (an extra is missing), or None."""
    for extra in (n for n in s.needs if n in EXTRAS):
        missing = missing_modules(extra)
        if missing:
            return f"needs {missing[0]}: pip install 'reliable-kafka[{extra}]'"
    return None


@click.command("lab")
@click.argument("names", nargs=-1, metavar="[SCENARIO ...]")
@connection_options("Use the running `reliable-kafka cluster` at these brokers (default: the running one, "
                    "else a cluster started for the run).", env_default=False)
@click.option("--state-file", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--json", "json_path", default=None, metavar="PATH", help="Write the results as JSON ('-' = stdout).")
@click.option("--list", "list_only", is_flag=True, help="List the scenarios and exit.")
def lab(names: tuple[str, ...], bootstrap_servers: str | None, config_file: Path | None, overrides: tuple[str, ...],
        state_file: Path | None, json_path: str | None, list_only: bool) -> None:
    """Reproduce the classic Kafka loss scenarios: an unsafe control client loses, reliable_kafka does not.

    Exit code 0: every control lost or duplicated and reliable_kafka did neither. 1: reliable_kafka lost
    or duplicated something. 3: a control did not bite or a scenario gave no verdict (nothing proven).
    4: the cluster could not be started or reached. A scenario whose extra is not installed is skipped
    and said so.
    """
    known = scenarios()
    if list_only:
        table("lab scenarios", ["name", "what happens"], [[s.name, s.description] for s in known.values()])
        return
    unknown = [n for n in names if n not in known]
    if unknown:
        fail(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(known)}", code=2)
    wanted = [known[n] for n in names] if names else list(known.values())
    skipped = {s.name: why for s in wanted if (why := missing_part(s)) is not None}
    chosen = [s for s in wanted if s.name not in skipped]
    check_writable(json_path)
    # RELIABLE_KAFKA_CONFIG names the user's own cluster, which the lab never breaks: only explicit options.
    given = connection_config(bootstrap_servers, config_file, overrides, code=2, use_env=False)
    results: list[ScenarioResult] = []
    errored: dict[str, str] = {}
    started = time.monotonic()
    if chosen:
        needs_five = any("5-node cluster" in s.needs for s in chosen)
        cluster, owned = _cluster_for(given, state_file, 5 if needs_five else 3)
        hide_secrets_in_client_logs(cluster.client_config())
        if needs_five and max(len(cluster.nodes), cluster.brokers if owned else 0) < 5:
            fail(f"unclean-election needs 5 nodes (3 controllers + 2 broker-only), the cluster at "
                 f"{cluster.bootstrap_servers} has {len(cluster.nodes)}: `reliable-kafka cluster stop` and let the "
                 "lab start its own, or `reliable-kafka cluster start --brokers 5`", code=NO_CLUSTER)
        with chatter_to_file("lab"):
            _run(chosen, cluster, owned, results, errored)
    rows = [[r.name, r.client, r.acked, r.consumed_unique, r.lost, r.duplicates, r.duplicates_after_dedup,
             f"{r.seconds:.1f}", r.detail] for r in results if r.name not in errored]
    rows += [[name, "-", "", "", "", "", "", "", f"no verdict: {why}"] for name, why in sorted(errored.items())]
    rows += [[name, "-", "", "", "", "", "", "", f"skipped ({why})"] for name, why in skipped.items()]
    table(f"loss lab ({time.monotonic() - started:.0f}s)",
          ["scenario", "client", "acked", "consumed", "lost", "duplicates", "dups after dedup", "s", "detail"], rows,
          to_stderr=json_path == "-")
    code, notes = verdict(results, errored)
    if json_path is not None:
        emit_json({"scenarios": [r.as_json() for r in results if r.name not in errored],
                   "errored": errored, "skipped": skipped, "exit_code": code}, json_path)
    for note in notes[:-1] if code == OURS_LOST else notes:
        console.print(f"[yellow]note:[/] {note}")
    if code == OURS_LOST:
        fail(notes[-1], code=OURS_LOST)
    if code != OK:
        sys.exit(code)


def _run(chosen: list[Scenario], cluster: LocalKafkaCluster, owned: bool, results: list[ScenarioResult],
         errored: dict[str, str]) -> None:
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
                    errored[s.name] = f"scenario error: {exc}"
                    cluster.heal()
                else:
                    bar.update(task, completed=1.0, step="done")
    except ClusterError as exc:
        fail(str(exc), code=NO_CLUSTER)
    finally:
        if owned:
            cluster.stop()


__all__ = ["lab", "verdict"]
