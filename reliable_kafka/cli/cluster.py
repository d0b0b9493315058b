"""`reliable-kafka cluster`: run the local real Kafka cluster by hand.

The cluster's pids and ports live in a small state file so that `stop` and `status` in a later
shell find exactly the processes `start` created, and nothing else.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import click

from reliable_kafka.cli.output import emit_json, fail, table
from reliable_kafka.errors import ClusterError
from reliable_kafka.testing import class_archive
from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.jars import KAFKA_VERSION, java_executable, kafka_libs
from reliable_kafka.testing.security import MODES

log = logging.getLogger(__name__)


def default_state_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "reliable-kafka"
    return Path(os.environ.get("RK_CLUSTER_STATE", base / "cluster.json"))


state_option = click.option(
    "--state-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
    help="Where the running cluster's pids and ports are kept (default ~/.cache/reliable-kafka/cluster.json).",
)


@click.group("cluster")
def cluster_group() -> None:
    """Start, inspect and stop a local real Kafka cluster (KRaft, one JVM per node, loopback only)."""


@cluster_group.command("fetch")
def fetch() -> None:
    """Fetch the Kafka server jars with Maven (once; cached outside the work tree)."""
    try:
        libs = kafka_libs()
        # Once per jars and Java runtime: later node starts map the classes instead of loading them.
        archive = class_archive.build(libs, java_executable())
    except ClusterError as exc:
        fail(str(exc))
    click.echo(f"Kafka {KAFKA_VERSION} jars ready in {libs}")
    if archive is not None:
        click.echo(f"class archive of the Kafka node ready in {archive}")


@cluster_group.command("start")
@click.option("--brokers", type=click.IntRange(1, 5), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the cluster description as JSON.")
@click.option("--security", type=click.Choice([m for m in MODES if m is not None]), default=None,
              help="Secure the client listener: TLS, SASL login (PLAIN or SCRAM-SHA-512) with ACLs, or both. The "
                   "super user's client settings go to a properties file beside the state (for --config).")
@state_option
def start(brokers: int, as_json: bool, security: str | None, state_file: Path | None) -> None:
    """Start a cluster that keeps running after this command returns."""
    state = state_file or default_state_file()
    if state.exists():
        existing = LocalKafkaCluster.attach(state)
        if any(n.alive() for n in existing.nodes.values()):
            fail(f"a cluster is already running ({existing.bootstrap_servers}); stop it first (state: {state})")
        state.unlink()
    data_dir = state.parent / "cluster-data"
    cluster = LocalKafkaCluster(brokers=brokers, data_dir=data_dir, die_with_parent=False, security=security)
    try:
        cluster.start()
        cluster.wait_healthy()
    except ClusterError as exc:
        fail(str(exc))
    state.parent.mkdir(parents=True, exist_ok=True)
    cluster.save_state(state)
    properties = LocalKafkaCluster.client_properties_path(state) if security else None
    if as_json:
        emit_json({**cluster.describe(), "client_properties": str(properties) if properties else None})
    else:
        click.echo(f"Kafka {KAFKA_VERSION} cluster running: bootstrap servers {cluster.bootstrap_servers}")
        if properties is not None:
            click.echo(f"secured ({security}); the super user's client settings: --config {properties}")
        click.echo(f"stop it with: reliable-kafka cluster stop --state-file {state}")


@cluster_group.command("status")
@click.option("--json", "as_json", is_flag=True)
@state_option
def status(as_json: bool, state_file: Path | None) -> None:
    """Show the nodes of the running cluster."""
    state = state_file or default_state_file()
    if not state.exists():
        fail(f"no cluster state at {state}: start one with `reliable-kafka cluster start`")
    cluster = LocalKafkaCluster.attach(state)
    desc = cluster.describe()
    if as_json:
        emit_json(desc)
        return
    table(
        f"cluster {desc['cluster_id']} — {desc['bootstrap_servers']}",
        ["node", "broker port", "controller port", "pid", "alive"],
        [[n["node_id"], n["broker_port"], n["controller_port"], n["pid"], n["alive"]] for n in desc["nodes"]],
    )


@cluster_group.command("stop")
@state_option
def stop(state_file: Path | None) -> None:
    """Stop the running cluster (only the pids it recorded) and remove its data."""
    state = state_file or default_state_file()
    if not state.exists():
        fail(f"no cluster state at {state}: nothing to stop")
    cluster = LocalKafkaCluster.attach(state)
    cluster.stop(graceful=True)
    shutil.rmtree(state.parent / "cluster-data", ignore_errors=True)
    LocalKafkaCluster.client_properties_path(state).unlink(missing_ok=True)
    state.unlink()
    click.echo("cluster stopped")
