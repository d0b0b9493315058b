"""A class-data-sharing (AppCDS) archive of the Kafka node's classes, so a node's JVM maps them instead
of loading, parsing and verifying them again on every start.

Local clusters start JVMs all the time: every cluster, every node a fault scenario kills and restarts,
every storage format. On the 2-core test host a one-node broker reached `healthy` in 4.2-7.0 s using
4.2-4.8 CPU-seconds without the archive, and in 3.4-3.8 s using 3.6-4.1 CPU-seconds with it.

The archive is built once per Kafka jars directory and Java runtime (`reliable-kafka cluster fetch`, run by
the set-up): a one-node cluster is started with `-XX:ArchiveClassesAtExit`, used (a topic, idempotent and
transactional sends, a group read) so the classes those paths load are in it, and stopped cleanly, which
is when the JVM writes the archive. Where it lives and the flags that map it are jars.py's (beside the
jars). Nodes use it when it is there; without it they start as before. A JVM
that finds the archive does not match it (another Java build, other jars) ignores it and says so in its
log: sharing is an optimisation, never a condition of starting.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS, LocalKafkaCluster
from reliable_kafka.testing.jars import class_archive_path

log = logging.getLogger(__name__)


def build(libs: Path, java: str) -> Path | None:
    """Build the archive unless it exists; its path, or None when none could be built (logged)."""
    target = class_archive_path(libs, java)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written under a name of its own and renamed: a concurrent build or a node starting meanwhile never
    # sees half an archive.
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        _run_and_stop(LocalKafkaCluster(brokers=1, jvm_options=QUICK_START_JVM_OPTIONS, archive_classes_to=partial))
    except Exception as exc:  # noqa: BLE001 - an optimisation: nodes start without it, slower
        log.warning("could not build the Kafka node's class archive (%s); nodes start without one", exc)
        partial.unlink(missing_ok=True)
        return None
    if not partial.is_file():
        log.warning("the Kafka node's JVM wrote no class archive; nodes start without one")
        return None
    os.replace(partial, target)
    log.info("class archive of the Kafka node written to %s", target)
    return target


def _run_and_stop(cluster: LocalKafkaCluster) -> None:
    """Start the node, take it down the paths tests and the lab take, and stop it cleanly."""
    from confluent_kafka import Consumer, Producer

    with cluster:
        cluster.wait_healthy()
        cluster.create_topic("rk-class-archive", 1, 1)
        servers = cluster.bootstrap_servers
        producer = Producer({"bootstrap.servers": servers, "enable.idempotence": True})
        producer.produce("rk-class-archive", b"x")
        producer.flush(30)
        txn = Producer({"bootstrap.servers": servers, "transactional.id": "rk-class-archive"})
        txn.init_transactions(30)
        txn.begin_transaction()
        txn.produce("rk-class-archive", b"y")
        txn.commit_transaction(30)
        consumer = Consumer({"bootstrap.servers": servers, "group.id": "rk-class-archive",
                             "auto.offset.reset": "earliest", "isolation.level": "read_committed"})
        consumer.subscribe(["rk-class-archive"])
        for _ in range(30):
            if consumer.poll(1.0) is not None:
                break
        consumer.close()
        # The JVM writes the archive as it exits: only a clean stop (SIGTERM) gets there.
        cluster.stop(graceful=True, timeout=60.0)
