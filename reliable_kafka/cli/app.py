"""The `reliable-kafka` click group: wires the sub-commands and logging (main.py is the entry point)."""

from __future__ import annotations

import logging

import click

from reliable_kafka.cli.bench import bench
from reliable_kafka.cli.cluster import cluster_group
from reliable_kafka.cli.doctor import doctor
from reliable_kafka.cli.lab import lab
from reliable_kafka.cli.outbox import outbox_group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", count=True, help="More log output (-v info, -vv debug).")
@click.version_option(package_name="reliable-kafka")
def cli(verbose: int) -> None:
    """reliable-kafka: Kafka without lost or duplicated messages."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


cli.add_command(cluster_group)
cli.add_command(lab)
cli.add_command(doctor)
cli.add_command(bench)
cli.add_command(outbox_group)
