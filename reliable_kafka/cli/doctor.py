"""`reliable-kafka doctor`: audit a cluster for the replication traps of the seeds.

Exit code 2 when a critical finding exists, 1 when the cluster cannot be reached.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from confluent_kafka import KafkaException
from rich.markup import escape

from reliable_kafka.admin import admin_client
from reliable_kafka.cli.connection import connection_config, connection_options, redact, running_cluster
from reliable_kafka.cli.output import emit_json, fail, table
from reliable_kafka.doctor import CRITICAL, WARNING, diagnose
from reliable_kafka.errors import ReliableKafkaError

_STYLE = {CRITICAL: "[bold red]critical[/]", WARNING: "[yellow]warning[/]"}


@click.command("doctor")
@connection_options("Brokers to audit (host:port,...); default: the cluster `reliable-kafka cluster start` runs.")
@click.option("--json", "as_json", is_flag=True, help="Print findings as JSON.")
@click.option("--all", "show_ok", is_flag=True, help="Also list the checks that passed.")
def doctor(bootstrap_servers: str | None, config_file: Path | None, overrides: tuple[str, ...], as_json: bool,
           show_ok: bool) -> None:
    """Audit replication factors, min ISR, unclean election and the internal topics."""
    conf = connection_config(bootstrap_servers, config_file, overrides) or {}
    if "bootstrap.servers" not in conf:
        local = running_cluster()
        if local is None:
            fail("give --bootstrap-servers or bootstrap.servers in --config (no local cluster is running)")
            return
        conf = {**local.client_config(), **conf}  # a secured local cluster: log in as its super user
    where = conf["bootstrap.servers"]
    try:
        # A short socket timeout unless the user chose one: an unreachable cluster is said within seconds.
        # A refused login is said as one (AuthenticationFailed), never as unreachable brokers.
        findings = diagnose(admin_client(where, {"socket.timeout.ms": 5000, **conf}), timeout=10)
    except (ReliableKafkaError, KafkaException) as exc:
        # A client's error may quote a setting's value (librdkafka names an invalid one): never a secret.
        fail(f"cannot audit {where}: {redact(str(exc), conf)}")
        return
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
