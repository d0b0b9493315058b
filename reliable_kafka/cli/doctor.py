"""`reliable-kafka doctor`: audit a cluster for the replication traps of the seeds.

Exit code 2 when a critical finding exists, 1 when the cluster cannot be reached.
"""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from reliable_kafka.admin import admin_client
from reliable_kafka.cli.cluster import default_state_file
from reliable_kafka.cli.output import emit_json, fail, table
from reliable_kafka.doctor import CRITICAL, WARNING, diagnose
from reliable_kafka.errors import ReliableKafkaError
from reliable_kafka.testing.cluster import LocalKafkaCluster

_STYLE = {CRITICAL: "[bold red]critical[/]", WARNING: "[yellow]warning[/]"}


@click.command("doctor")
@click.option("--bootstrap-servers", default=None,
              help="Brokers to audit (host:port,...); default: the cluster `reliable-kafka cluster start` runs.")
@click.option("--json", "as_json", is_flag=True, help="Print findings as JSON.")
@click.option("--all", "show_ok", is_flag=True, help="Also list the checks that passed.")
def doctor(bootstrap_servers: str | None, as_json: bool, show_ok: bool) -> None:
    """Audit replication factors, min ISR, unclean election and the internal topics."""
    if bootstrap_servers is None:
        state = default_state_file()
        if not state.exists():
            fail("give --bootstrap-servers (no local cluster is running)")
        bootstrap_servers = LocalKafkaCluster.attach(state).bootstrap_servers
    try:
        findings = diagnose(admin_client(bootstrap_servers, {"socket.timeout.ms": 5000}), timeout=10)
    except ReliableKafkaError as exc:
        fail(f"cannot audit {bootstrap_servers}: {exc}")
    if as_json:
        emit_json({"findings": [f.as_json() for f in findings]})
    else:
        shown = findings if show_ok else [f for f in findings if f.severity != "ok"]
        if shown:
            table("doctor", ["severity", "check", "subject", "detail", "fix"],
                  [[_STYLE.get(f.severity, f.severity), *(escape(v) for v in (f.check, f.subject, f.detail, f.fix))]
                   for f in shown], markup=True)
        else:
            click.echo(f"no problems found ({len(findings)} checks passed)")
    if any(f.severity == CRITICAL for f in findings):
        sys.exit(2)
