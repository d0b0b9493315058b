"""The benchmark scripts' cluster: a local 3-node cluster started for one run of a script, its client
settings, and the bench CLI's topic maker; the cluster is stopped however the script ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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
