"""The benchmark scripts' cluster: a local 3-node cluster started for one run of a script, its client
settings, and the bench CLI's topic maker; the cluster is stopped however the script ends. Also what the
eos scripts share: the seeded input, the interleaved copies, and a script's `--out PATH`."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from reliable_kafka.bench import eos
from reliable_kafka.bench.worker import produce_raw
from reliable_kafka.cli.bench import _create_topic_fn
from reliable_kafka.testing.cluster import LocalKafkaCluster


@contextmanager
def bench_cluster(brokers: int = 3) -> Iterator[tuple[LocalKafkaCluster, dict[str, Any], Callable[..., Any]]]:
    cluster = LocalKafkaCluster(brokers=brokers)
    cluster.start()
    try:
        cluster.wait_healthy()
        conn = cluster.client_config()
        yield cluster, conn, _create_topic_fn(conn)
    finally:
        cluster.stop()


def out_path(argv: list[str], default: Path) -> tuple[Path, list[str]]:
    """A script's `--out PATH` (first among its arguments) and the arguments after it; else `default`."""
    if argv[:1] == ["--out"]:
        return Path(argv[1]), argv[2:]
    return default, argv


def eos_script_args(argv: list[str], child: Callable[[str, str, str, int], None],
                    default: Path) -> tuple[Path, list[str]] | None:
    """What an eos script that copies in child processes of its own was asked: `--child VARIANT SOURCE OUTPUT
    N` runs `child` (this process is one copy) and gives None; otherwise `--out PATH` and the arguments after it."""
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], argv[3], int(argv[4]))
        return None
    return out_path(argv, default)


@contextmanager
def seeded_eos_cluster(name: str, messages: int) -> Iterator[tuple[dict[str, Any], Callable[..., Any], str]]:
    """A cluster for the eos scripts, its input topic seeded as `bench eos` seeds it (MESSAGES records with
    rk-ids, in eos.PARTITIONS partitions): yields (client settings, topic maker, the input topic)."""
    with bench_cluster() as (_cluster, conn, create):
        yield conn, create, seed_eos_input(conn, create, name, messages)


def seed_eos_input(conn: dict[str, Any], create: Callable[..., Any], name: str, messages: int) -> str:
    """A new input topic seeded as `bench eos` seeds it (MESSAGES records with rk-ids, in eos.PARTITIONS
    partitions); returns its name."""
    source = f"{name}-in-{uuid.uuid4().hex[:6]}"
    create(source, eos.PARTITIONS)
    produce_raw(conn, source, messages, with_ids=True)
    return source


def eos_copies(create: Callable[..., Any], name: str, variants: Iterable[str], messages: int, rounds: int,
               ) -> Iterator[tuple[bool, str, str, int]]:
    """The copies of an eos script, as `bench eos` interleaves them: (measured, variant, output topic made for
    it, records to copy) for one unmeasured copy of up to eos.WARM_UP_RECORDS records per variant, then
    ROUNDS rounds of a full copy per variant."""
    listed = list(variants)
    for r in range(rounds + 1):
        for variant in listed:
            output = f"{name}-{variant}-{uuid.uuid4().hex[:6]}"
            create(output, eos.PARTITIONS)
            yield r > 0, variant, output, messages if r else min(messages, eos.WARM_UP_RECORDS)
