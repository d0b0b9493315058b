"""LocalKafkaCluster: a real Apache Kafka cluster (KRaft, one JVM per node) on loopback for tests and labs.

It can kill, pause, resume and restart single nodes; it signals only the pids it started itself,
and stop() resumes paused nodes before it ends every process, also when a test failed.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewTopic,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)

from reliable_kafka.errors import ClusterError
from reliable_kafka.kafka_errors import Disposition
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.testing.jars import LOG4J_CONFIG, class_archive_options, java_executable, kafka_libs
from reliable_kafka.testing.security import ClusterSecurity

log = logging.getLogger(__name__)

# Tuned for fault tests on one small host: fast failure detection and failover, few internal partitions.
_FAST_FAULT_SETTINGS: dict[str, Any] = {
    "broker.heartbeat.interval.ms": 500,
    "broker.session.timeout.ms": 3000,
    "replica.lag.time.max.ms": 5000,
    "controller.quorum.election.timeout.ms": 1000,
    "controller.quorum.fetch.timeout.ms": 2000,
    "group.initial.rebalance.delay.ms": 0,
    "offsets.topic.num.partitions": 6,
    "transaction.state.log.num.partitions": 6,
    "num.partitions": 1,
    "auto.create.topics.enable": False,
    "unclean.leader.election.enable": False,
    "num.network.threads": 2,
    "num.io.threads": 4,
    "background.threads": 4,
    "log.cleaner.threads": 1,
    "group.consumer.heartbeat.interval.ms": 1000,
    "group.consumer.min.heartbeat.interval.ms": 500,
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": 5000,
    # The active controller appends a no-op record to the metadata log this often (default 500 ms), and
    # every node replicates it: an idle 3-node cluster used 8.6 CPU-seconds a minute with the default and
    # 7.0 with 5 s (measured on the 2-core test host). Failure detection does not depend on it.
    "metadata.max.idle.interval.ms": 5000,
    # How long a follower's fetch waits at the leader when there is nothing new (default 500 ms). New
    # records end the wait at once, so acks=all latency and ISR membership (a fetch every 2 s is well
    # within replica.lag.time.max.ms) do not depend on it; what it sets is how often idle partitions are
    # fetched for nothing. An idle 3-node cluster used 5.5 CPU-seconds a minute with the default and 4.2
    # with 2 s; with 100 topics of 3 partitions more (what a suite run leaves on its cluster), 8.0 and 4.3
    # (measured on the 2-core test host, 30 s each).
    "replica.fetch.wait.max.ms": 2000,
}

# For clusters that prove faults, not speed (the test suite's): the JIT's first tier only. A broker's
# restart to registration took 6.9 CPU-seconds with both tiers and 3.7-4.7 with C1 alone, a 3-node start
# 22 and 15 (measured on the 2-core test host, three restarts each): the optimising compiler's work pays
# off only in long, busy runs, so benchmarks keep the JVM's default.
QUICK_START_JVM_OPTIONS: tuple[str, ...] = ("-XX:TieredStopAtLevel=1",)


_PR_SET_PDEATHSIG = 1

# librdkafka's connection chatter (refused connects while nodes are down) goes to logging, not stderr.
_RDKAFKA_LOG = logging.getLogger("reliable_kafka.testing.rdkafka")


def _die_with_parent() -> None:
    """Runs in the child before exec: the JVM gets SIGKILL if the process that started it dies.

    Without it a crashed test run leaves JVMs behind that hold ports and memory.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


# Ports for the servers the harness starts are drawn from below the kernel's ephemeral range (Linux:
# 32768-60999). A port the kernel hands out (bind to port 0, the local end of any outgoing connection,
# a Spark driver, a mock broker) was free when checked and taken seconds later, before the JVM bound
# it: "Socket server failed to bind ... Address already in use" on a cluster's start, and on a broker
# restarted after a SIGKILL, whose port had been free meanwhile. Below that range only a process that
# picks a port number on purpose can collide.
_PORTS = range(20_000, 32_000)
_handed_out: set[int] = set()  # never the same port twice from this process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now and that the kernel never hands out itself."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(_PORTS)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise ClusterError(f"no free TCP port in {_PORTS.start}-{_PORTS.stop - 1} on 127.0.0.1 after 200 tries")


def _cluster_id() -> str:
    # StorageTool's argument parser reads an id starting with "-" as an option: never hand it one.
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def _read_properties(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def _prop(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass
class KafkaNode:
    """One combined broker+controller process."""

    node_id: int
    broker_port: int
    controller_port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None
    pid: int | None = None  # kept separately so a cluster re-attached from a state file can signal it
    paused: bool = False
    starts: int = 0

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    @property
    def config_path(self) -> Path:
        return self.directory / "server.properties"

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        # A re-attached pid could have been reused by an unrelated process: check it is our JVM.
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes()
        except OSError:
            return False
        return str(self.config_path).encode() in cmdline


def _no_leader_in_cache(exc: KafkaException) -> Disposition:
    """delete_records' only retriable error: librdkafka's "No leaders found" (_NOENT), which it answers at
    once when its metadata cache names no leader for a partition."""
    return Disposition.RETRIABLE if exc.args[0].code() == KafkaError._NOENT else Disposition.PERMANENT


@dataclass
class PartitionState:
    leader: int
    replicas: list[int]
    isr: list[int]


@dataclass
class LocalKafkaCluster:
    """A real Kafka cluster of `brokers` combined KRaft nodes on 127.0.0.1.

    Use it as a context manager (or start()/stop()). Node ids start at 1. Broker settings can be
    overridden with `broker_config`, e.g. {"offsets.topic.replication.factor": 1} to reproduce the
    single-replica internal topic trap.
    """

    brokers: int = 3
    broker_config: Mapping[str, Any] = field(default_factory=dict)
    # Nodes 1..controllers are combined broker+controller (the KRaft quorum); the rest are broker-only,
    # so a scenario can take brokers away without touching the quorum. Default: min(brokers, 3).
    controllers: int | None = None
    heap_mb: int = 384
    # Extra JVM flags for every node (and the storage format runs), e.g. QUICK_START_JVM_OPTIONS.
    jvm_options: Sequence[str] = ()
    data_dir: str | os.PathLike[str] | None = None
    die_with_parent: bool = True
    cluster_id: str = field(default_factory=_cluster_id)
    nodes: dict[int, KafkaNode] = field(default_factory=dict, init=False)
    _owns_data_dir: bool = field(default=False, init=False)
    _started: bool = field(default=False, init=False)
    _admin_cache: tuple[tuple[int, ...], AdminClient] | None = field(default=None, init=False, repr=False)
    # Set for a cluster re-attached from a state file: every node (re)start is written back to it,
    # so `reliable-kafka cluster stop` finds the new pids too.
    state_path: Path | None = field(default=None, init=False)
    # None: an open PLAINTEXT cluster; else one of security.MODES: "tls" (encrypted, open), or
    # "sasl-plain" / "sasl-scram" (+ "+tls"): clients log in with SASL and are authorized by Kafka's
    # StandardAuthorizer (no ACL, no access); the harness itself is the super user "admin". `users` adds
    # principals ({name: password}) that start with no ACL at all (SCRAM: add_user() adds more later).
    security: str | None = None
    users: Mapping[str, str] = field(default_factory=dict, repr=False)
    # Only for class_archive.build(): the nodes write their class archive here when they stop cleanly.
    archive_classes_to: Path | None = field(default=None, repr=False)
    _security: ClusterSecurity = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # A lone string would otherwise be taken apart into one-character JVM flags.
        if isinstance(self.jvm_options, str):
            raise TypeError(f"jvm_options takes a sequence of flags, e.g. ({self.jvm_options!r},), not a string")
        self._security = ClusterSecurity(self.security)
        if "admin" in self.users:
            raise ValueError("'admin' is the harness's own super user: name the other principals differently")

    # ---- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> LocalKafkaCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> LocalKafkaCluster:
        """Format storage and start every node; returns once all brokers are registered."""
        if self.brokers < 1:
            raise ClusterError(f"brokers must be at least 1, got {self.brokers}")
        libs = kafka_libs()
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="rk-kafka-")
            self._owns_data_dir = True
        root = Path(self.data_dir)
        root.mkdir(parents=True, exist_ok=True)
        for node_id in range(1, self.brokers + 1):
            directory = root / f"node-{node_id}"
            directory.mkdir(parents=True, exist_ok=True)
            self.nodes[node_id] = KafkaNode(node_id, free_port(), free_port(), directory)
        self._security.prepare(root / "tls", java_executable())
        for node in self.nodes.values():
            node.config_path.write_text(self._server_properties(node))
        self._format_storage(libs)
        self._started = True
        try:
            for node in self.nodes.values():
                self._launch(node, libs)
            self.wait_brokers(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        log.info("Kafka cluster up: %s", self.bootstrap_servers)
        return self

    def stop(self, *, graceful: bool = False, timeout: float = 15.0) -> None:
        """Stop every node: paused ones are resumed first so they can die. Removes a temporary data dir."""
        for node in self.nodes.values():
            if node.paused:
                self.resume(node.node_id)
        if graceful:
            for node in self.nodes.values():
                self._signal(node, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for node in self.nodes.values():
                self._wait_exit(node, max(0.1, deadline - time.monotonic()))
        for node in self.nodes.values():
            if node.alive():
                self._signal(node, signal.SIGKILL)
                self._wait_exit(node, 10.0)
        self._started = False
        self._admin_cache = None
        if self._owns_data_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"127.0.0.1:{n.broker_port}" for n in self.nodes.values())

    def bootstrap_of(self, *node_ids: int) -> str:
        return ",".join(f"127.0.0.1:{self.nodes[i].broker_port}" for i in node_ids)

    @property
    def node_ids(self) -> list[int]:
        return sorted(self.nodes)

    @property
    def controller_ids(self) -> list[int]:
        """The KRaft voters (broker+controller nodes); any other node is a broker only."""
        return [n.node_id for n in self._quorum()]

    def running_nodes(self) -> list[int]:
        """Nodes whose process lives and is not paused."""
        return [i for i, n in sorted(self.nodes.items()) if n.alive() and not n.paused]

    # ---- faults ----------------------------------------------------------------------------

    def kill(self, node_id: int) -> None:
        """SIGKILL the node: no controlled shutdown, unflushed page cache stays (the OS keeps it)."""
        node = self._node(node_id)
        if node.paused:
            self.resume(node_id)
        self._signal(node, signal.SIGKILL)
        self._wait_exit(node, 10.0)

    def stop_node(self, node_id: int, timeout: float = 30.0) -> None:
        """SIGTERM the node and wait for its controlled shutdown (SIGKILL after `timeout`)."""
        node = self._node(node_id)
        if node.paused:
            self.resume(node_id)
        self._signal(node, signal.SIGTERM)
        if not self._wait_exit(node, timeout):
            self._signal(node, signal.SIGKILL)
            self._wait_exit(node, 10.0)

    def pause(self, node_id: int) -> None:
        """SIGSTOP the node: it keeps its sockets but answers nothing (a GC pause or a hung host)."""
        node = self._node(node_id)
        if not node.alive():
            raise ClusterError(f"node {node_id} is not running; cannot pause it")
        self._signal(node, signal.SIGSTOP)
        node.paused = True

    def resume(self, node_id: int) -> None:
        """SIGCONT a paused node."""
        node = self._node(node_id)
        if node.alive():
            self._signal(node, signal.SIGCONT)
        node.paused = False

    def start_node(self, node_id: int, *, wait: bool = True, timeout: float = 60.0) -> None:
        """Start a node that was killed or stopped, on its old ports and data."""
        node = self._node(node_id)
        if node.alive():
            return
        self._launch(node, kafka_libs())
        if wait:
            self.wait_brokers(timeout=timeout)

    def restart(self, node_id: int, *, hard: bool = True, wait: bool = True, timeout: float = 60.0) -> None:
        """Kill (hard) or stop (graceful) the node, then start it again."""
        if hard:
            self.kill(node_id)
        else:
            self.stop_node(node_id)
        self.start_node(node_id, wait=wait, timeout=timeout)

    def heal(self, timeout: float = 90.0) -> None:
        """Resume paused nodes, start dead ones and wait until nothing is under-replicated."""
        for node_id, node in self.nodes.items():
            if node.paused:
                self.resume(node_id)
            if not node.alive():
                self.start_node(node_id, wait=False)
        self.wait_healthy(timeout=timeout)

    # ---- inspection ------------------------------------------------------------------------

    def admin(self, **config: Any) -> AdminClient:
        """An AdminClient bootstrapped only from nodes that run and are not paused.

        A paused broker still accepts TCP connections (the kernel does) but never answers, so it
        must not be the bootstrap a test depends on.
        """
        running = tuple(self.running_nodes())
        if not running:
            raise ClusterError("no running node to talk to")
        if config:
            return AdminClient({**self._admin_conf(running), **config})
        # Inspection runs in tight wait loops: one client per set of running nodes, not one per call.
        if self._admin_cache is None or self._admin_cache[0] != running:
            self._admin_cache = (running, AdminClient(self._admin_conf(running)))
        return self._admin_cache[1]

    def _admin_conf(self, running: tuple[int, ...]) -> dict[str, Any]:
        return {
            **self.client_config("admin"),
            "bootstrap.servers": self.bootstrap_of(*running),
            "socket.timeout.ms": 5000,
            "logger": _RDKAFKA_LOG,
        }

    def broker_setting(self, key: str, default: Any = None) -> Any:
        """A setting every node runs with that the harness chose or `broker_config` gave (not Kafka's own
        defaults: `default` stands for those)."""
        return {**_FAST_FAULT_SETTINGS, **dict(self.broker_config)}.get(key, default)

    def client_config(self, user: str = "admin") -> dict[str, Any]:
        """librdkafka settings that reach this cluster as `user` ("admin": the super user the harness
        itself is). On an open cluster, just the bootstrap servers."""
        return {"bootstrap.servers": self.bootstrap_servers, **self._security.client_settings(user, dict(self.users))}

    def add_user(self, name: str, password: str) -> None:
        """Create a SCRAM principal on the running cluster (security="sasl-scram"); it has no ACL yet."""
        if self._security.mechanism != "SCRAM-SHA-512":
            raise ClusterError(f"add_user needs SCRAM (security='sasl-scram'; this cluster: {self.security!r}); "
                               "SASL/PLAIN users are fixed when the cluster starts: pass users={...}")
        if name == "admin":
            raise ValueError("'admin' is the harness's own super user: name the other principals differently")
        upsert = UserScramCredentialUpsertion(
            name, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), password.encode())
        for future in self.admin().alter_user_scram_credentials([upsert]).values():
            future.result(timeout=30)
        self.users = {**self.users, name: password}

    def partition_state(self, topic: str, partition: int = 0, timeout: float = 10.0) -> PartitionState | None:
        """Leader, replicas and ISR of a partition as the cluster's metadata says now (None if it stays
        unknown for `timeout`).

        A partition the metadata does not know is asked about again: the answer comes from any broker,
        and one that restarted a moment ago can answer without a topic created just before (seen: a test's
        first look at its new topic, right after another test's broker restart, found nothing).
        """
        deadline = time.monotonic() + timeout
        while True:
            md = self._retry(lambda: self.admin().list_topics(topic, timeout=5), max(1.0, deadline - time.monotonic()))
            t = md.topics.get(topic)
            if t is not None and t.error is None and partition in t.partitions:
                p = t.partitions[partition]
                return PartitionState(leader=p.leader, replicas=list(p.replicas), isr=list(p.isrs))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def leader_of(self, topic: str, partition: int = 0) -> int | None:
        """The node id that leads the partition, or None while it has no leader."""
        state = self.partition_state(topic, partition)
        return state.leader if state is not None and state.leader >= 0 else None

    def isr_of(self, topic: str, partition: int = 0) -> list[int]:
        state = self.partition_state(topic, partition)
        return sorted(state.isr) if state is not None else []

    def registered_brokers(self, timeout: float = 10.0) -> list[int]:
        md = self._retry(lambda: self.admin().list_topics(timeout=5), timeout)
        return sorted(md.brokers)

    def wait_brokers(self, timeout: float = 60.0) -> None:
        """Until every running node is registered as a broker.

        `timeout` bounds the time in which no running node's log grew. A broker restarted after SIGKILL
        recovers every partition's log before it registers; on a loaded 2-core host that alone has taken
        more than 60 s, while its log showed it at work all along. So the wait follows the nodes' logs and
        gives up only when they stall for `timeout`, or after 4 x `timeout` in all.
        """
        missing: set[int] = set(self.running_nodes())

        def registered() -> bool:
            missing.intersection_update(set(self.running_nodes()) - set(self.registered_brokers()))
            return not missing

        def logs_of_missing() -> tuple[int, ...]:
            # Only the nodes still to register: the others log their failed connections to them meanwhile.
            return tuple(self._log_size(n) for n in sorted(missing))

        self._wait(registered, timeout, "brokers to register", progress=logs_of_missing, cap=4 * timeout)

    def _log_size(self, node_id: int) -> int:
        try:
            return self._node(node_id).log_path.stat().st_size
        except OSError:
            return -1

    def under_replicated(self) -> list[tuple[str, int]]:
        """Partitions (internal ones included) whose ISR is smaller than their replica set, or leaderless."""
        md = self.admin().list_topics(timeout=5)
        bad = []
        for name, t in md.topics.items():
            for pid, p in t.partitions.items():
                if p.leader < 0 or set(p.isrs) != set(p.replicas):
                    bad.append((name, pid))
        return bad

    def wait_healthy(self, timeout: float = 90.0) -> None:
        """Until all nodes are up, registered, and no partition is under-replicated or leaderless.

        Like `wait_brokers`, the wait follows progress: each partition that rejoins its ISR moves the
        deadline on by `timeout` (never past 3 x `timeout` in all), so a follower that catches up slowly
        on a loaded host is waited for, and one that stopped catching up is not.
        """
        fewest: list[int | None] = [None]  # the fewest under-replicated partitions seen: it falls as they rejoin

        def healthy() -> bool:
            if set(self.running_nodes()) != set(self.nodes):
                return False
            if set(self.registered_brokers()) != set(self.nodes):
                return False
            behind = len(self.under_replicated())
            if fewest[0] is None or behind < fewest[0]:
                fewest[0] = behind
            return behind == 0

        self._wait(healthy, timeout, "the cluster to be healthy", progress=lambda: fewest[0], cap=3 * timeout)

    def wait_for_leader(
        self, topic: str, partition: int = 0, *, not_on: int | None = None, timeout: float = 60.0
    ) -> int:
        """Until the partition has a leader (other than `not_on`); returns it."""
        found: list[int] = []

        def elected() -> bool:
            leader = self.leader_of(topic, partition)
            if leader is None or leader == not_on:
                return False
            found.append(leader)
            return True

        self._wait(elected, timeout, f"a leader for {topic}[{partition}]")
        return found[-1]

    def wait_isr(self, topic: str, partition: int, expected: set[int], timeout: float = 60.0) -> None:
        self._wait(lambda: set(self.isr_of(topic, partition)) == expected, timeout, f"ISR {sorted(expected)}")

    def create_topic(
        self,
        name: str,
        partitions: int = 1,
        replication_factor: int | None = None,
        configs: Mapping[str, Any] | None = None,
        *,
        assignment: list[list[int]] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Create a topic and wait until every partition has a leader and a full ISR.

        `assignment` places replicas by hand (one list of node ids per partition, preferred leader first).
        """
        config = {k: _prop(v) for k, v in (configs or {}).items()}
        if assignment is not None:
            partitions, rf = len(assignment), len(assignment[0])
            new = NewTopic(name, num_partitions=partitions, replica_assignment=assignment, config=config)
        else:
            rf = replication_factor if replication_factor is not None else min(3, self.brokers)
            new = NewTopic(name, num_partitions=partitions, replication_factor=rf, config=config)
        admin = self.admin()  # keep a reference: futures fail with _DESTROY if the client is collected
        futures = admin.create_topics([new], operation_timeout=timeout)
        try:
            futures[name].result(timeout=timeout)
        except KafkaException as exc:
            raise ClusterError(f"could not create topic {name!r}: {exc}") from exc

        def ready() -> bool:
            md = self.admin().list_topics(name, timeout=5)
            t = md.topics.get(name)
            if t is None or t.error is not None or len(t.partitions) != partitions:
                return False
            return all(p.leader >= 0 and len(p.isrs) == rf for p in t.partitions.values())

        self._wait(ready, timeout, f"topic {name} to be ready")

    def delete_records(self, topic: str, before: Mapping[int, int], timeout: float = 60.0) -> dict[int, int]:
        """Delete the records of `topic` below the given offset of each partition (as retention would);
        returns each partition's new low watermark.

        librdkafka sends DeleteRecords to the leaders its metadata cache names, and answers at once with
        "No leaders found" (_NOENT) when that cache has none for the partition (seen once in CI on a loaded
        host, just after the partition was written to): the request is then sent again, with metadata asked
        afresh, until `timeout`. A refusal by the broker itself is raised as it is.
        """
        wanted = [TopicPartition(topic, p, offset) for p, offset in sorted(before.items())]
        attempts = 0

        def delete() -> dict[int, int]:
            nonlocal attempts
            admin = self.admin()
            if attempts:
                admin.list_topics(topic, timeout=5)  # the cache named no leader: ask for metadata afresh
            attempts += 1
            futures = admin.delete_records(wanted, request_timeout=30)
            return {tp.partition: f.result(timeout=30).low_watermark for tp, f in futures.items()}

        return retry_kafka_call(delete, deadline_s=timeout, what=f"deleting records of {topic}",
                                classify=_no_leader_in_cache, retry_on=(Disposition.RETRIABLE,), log=log)

    def delete_topic(self, name: str, timeout: float = 30.0) -> None:
        admin = self.admin()
        admin.delete_topics([name], operation_timeout=timeout)[name].result(timeout=timeout)

    def topic_config(self, name: str) -> dict[str, str]:
        """The effective configuration of a topic (broker defaults included)."""
        res = ConfigResource(ConfigResource.Type.TOPIC, name)
        admin = self.admin()
        # Right after create_topic another broker may not know the topic yet: retry that moment.
        entries = retry_kafka_call(
            lambda: admin.describe_configs([res], request_timeout=10)[res].result(timeout=10),
            deadline_s=30,
            what=f"configuration of {name}",
        )
        return {k: v.value for k, v in entries.items()}

    def logs(self, node_id: int, tail: int = 200) -> str:
        """The last lines of a node's server log (kept for the whole life of the cluster)."""
        path = self._node(node_id).log_path
        if not path.exists():
            return ""
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    def describe(self) -> dict[str, Any]:
        """A JSON-friendly picture of the cluster: used by `reliable-kafka cluster status` and state files."""
        return {
            "cluster_id": self.cluster_id,
            "bootstrap_servers": self.bootstrap_servers,
            "security": self.security,  # never the passwords
            "controllers": len(self._quorum()) if self.nodes else self.controllers,
            "data_dir": str(self.data_dir),
            "nodes": [
                {
                    "node_id": n.node_id,
                    "broker_port": n.broker_port,
                    "controller_port": n.controller_port,
                    "pid": n.proc.pid if n.proc is not None else n.pid,
                    "alive": n.alive(),
                    "paused": n.paused,
                    "directory": str(n.directory),
                }
                for n in self.nodes.values()
            ],
        }

    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Write describe() to `path`; on a secured cluster also the super user's client settings, to a
        properties file beside it that only its owner may read (its path is in the state, never the secrets)."""
        state = self.describe()
        if self.security is not None:
            properties = self.client_properties_path(path)
            properties.touch(mode=0o600)
            properties.chmod(0o600)
            properties.write_text("".join(f"{k}={_prop(v)}\n" for k, v in self.client_config().items()))
            state["client_properties"] = str(properties)
        Path(path).write_text(json.dumps(state, indent=2))

    @staticmethod
    def client_properties_path(state: str | os.PathLike[str]) -> Path:
        """Where save_state(state) puts the super user's client settings: `--config` for the CLI."""
        return Path(state).with_name(Path(state).stem + "-admin.properties")

    @classmethod
    def attach(cls, path: str | os.PathLike[str]) -> LocalKafkaCluster:
        """Re-open a cluster started by another process from its state file (for `cluster stop|status`)."""
        state = json.loads(Path(path).read_text())
        cluster = cls(brokers=len(state["nodes"]), data_dir=state["data_dir"], cluster_id=state["cluster_id"],
                      die_with_parent=False, controllers=state.get("controllers"), security=state.get("security"))
        if state.get("client_properties"):
            admin = _read_properties(Path(state["client_properties"]))
            cluster._security = ClusterSecurity.restore(cluster.security, admin)
        for n in state["nodes"]:
            cluster.nodes[n["node_id"]] = KafkaNode(
                n["node_id"], n["broker_port"], n["controller_port"], Path(n["directory"]), pid=n["pid"],
                paused=n["paused"],
            )
        cluster._started = True
        cluster.state_path = Path(path)
        return cluster

    # ---- internals -------------------------------------------------------------------------

    def _node(self, node_id: int) -> KafkaNode:
        try:
            return self.nodes[node_id]
        except KeyError:
            raise ClusterError(f"no node {node_id}; nodes are {self.node_ids}") from None

    def _quorum(self) -> list[KafkaNode]:
        n = self.controllers if self.controllers is not None else min(3, self.brokers)
        return [self.nodes[i] for i in sorted(self.nodes)[:n]]

    def _server_properties(self, node: KafkaNode) -> str:
        internal_rf = min(3, self.brokers)
        voter = node in self._quorum()
        client = self._security.protocol
        listeners = f"{client}://127.0.0.1:{node.broker_port}"
        if voter:
            listeners += f",CONTROLLER://127.0.0.1:{node.controller_port}"
        settings: dict[str, Any] = {
            "process.roles": "broker,controller" if voter else "broker",
            "node.id": node.node_id,
            "controller.quorum.voters": ",".join(
                f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self._quorum()
            ),
            "listeners": listeners,
            "advertised.listeners": f"{client}://127.0.0.1:{node.broker_port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": client,
            "listener.security.protocol.map": f"{client}:{client},CONTROLLER:PLAINTEXT",
            **self._security.broker_settings(dict(self.users)),
            "log.dirs": str(node.directory / "data"),
            "default.replication.factor": internal_rf,
            "min.insync.replicas": min(2, internal_rf),
            "offsets.topic.replication.factor": internal_rf,
            "transaction.state.log.replication.factor": internal_rf,
            "transaction.state.log.min.isr": min(2, internal_rf),
            "share.coordinator.state.topic.replication.factor": internal_rf,
            "share.coordinator.state.topic.min.isr": min(2, internal_rf),
            **_FAST_FAULT_SETTINGS,
            **dict(self.broker_config),
        }
        return "".join(f"{k}={_prop(v)}\n" for k, v in settings.items())

    def _java_cmd(self, libs: Path, main: str, *args: str, heap_mb: int) -> list[str]:
        java = java_executable()
        if self.archive_classes_to is None:
            sharing = class_archive_options(libs, java)
        elif main == "kafka.Kafka":
            sharing = (f"-XX:ArchiveClassesAtExit={self.archive_classes_to}",)
        else:
            sharing = ()  # the storage format's classes are the node's too; its exit must not write the archive
        return [
            java,
            *sharing,
            f"-Xms{min(256, heap_mb)}m",
            f"-Xmx{heap_mb}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError",
            "-Djava.awt.headless=true",
            *self.jvm_options,
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp",
            f"{libs}/*",
            main,
            *args,
        ]

    def _format_storage(self, libs: Path) -> None:
        # Format all nodes at once: each is a short JVM run, and they are independent.
        procs = []
        scram = self._security.format_args(dict(self.users))
        for node in self.nodes.values():
            cmd = self._java_cmd(
                libs, "kafka.tools.StorageTool", "format", "-t", self.cluster_id, "-c", str(node.config_path),
                "--ignore-formatted", *scram, heap_mb=256,
            )
            procs.append((node, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
        for node, proc in procs:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                said = out.decode(errors="replace")
                for password in self._security.secrets(dict(self.users)):
                    said = said.replace(password, "***")
                raise ClusterError(f"formatting storage of node {node.node_id} failed: {said}")

    def _launch(self, node: KafkaNode, libs: Path) -> None:
        cmd = self._java_cmd(libs, "kafka.Kafka", str(node.config_path), heap_mb=self.heap_mb)
        logfile = open(node.log_path, "ab")  # noqa: SIM115 - handed to the child; closed right after spawn
        try:
            node.proc = subprocess.Popen(
                cmd,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=node.directory,
                preexec_fn=_die_with_parent if self.die_with_parent else None,  # noqa: PLW1509
                start_new_session=not self.die_with_parent,
            )
        finally:
            logfile.close()
        node.pid = node.proc.pid
        node.paused = False
        node.starts += 1
        if self.state_path is not None:
            self.save_state(self.state_path)

    def _signal(self, node: KafkaNode, sig: int) -> None:
        # Only the pid we started (or re-attached after checking its command line) is ever signalled.
        if not node.alive():
            return
        pid = node.proc.pid if node.proc is not None else node.pid
        assert pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def _wait_exit(self, node: KafkaNode, timeout: float) -> bool:
        if node.proc is not None:
            try:
                node.proc.wait(timeout=timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not node.alive():
                return True
            time.sleep(0.1)
        return not node.alive()

    def _retry(self, fn: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                return fn()
            except (KafkaException, ClusterError) as exc:
                last = exc
                time.sleep(0.2)
        raise ClusterError(f"the cluster did not answer within {timeout:.0f}s: {last}")

    def _wait(self, condition: Callable[[], bool], timeout: float, what: str, *,
              progress: Callable[[], object] | None = None, cap: float | None = None) -> None:
        """Until `condition()` holds, for `timeout`; with `progress`, the deadline moves on `timeout` from each
        change of `progress()` (the nodes are visibly at work), but never past `cap` from the start."""
        start = time.monotonic()
        deadline = start + timeout
        hard_deadline = start + (cap if cap is not None else timeout)
        seen = progress() if progress is not None else None
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            dead = [n.node_id for n in self.nodes.values() if n.proc is not None and n.proc.poll() is not None
                    and n.proc.returncode not in (-signal.SIGKILL, -signal.SIGTERM, 0)]
            if dead:
                raise ClusterError(
                    f"node(s) {dead} exited while waiting for {what}; last log lines:\n"
                    + "\n".join(self.logs(i, 40) for i in dead)
                )
            try:
                if condition():
                    return
            except (KafkaException, ClusterError) as exc:
                last_error = exc
            if progress is not None and (now := progress()) != seen:
                seen = now
                deadline = min(time.monotonic() + timeout, hard_deadline)
            time.sleep(0.25)
        raise ClusterError(
            f"timed out after {time.monotonic() - start:.0f}s waiting for {what}"
            + (f" ({timeout:.0f}s without progress in the nodes' logs)" if progress is not None else "")
            + (f" (last error: {last_error})" if last_error else "")
        )


def consume_all(
    bootstrap_servers: str,
    topic: str,
    *,
    isolation_level: str = "read_committed",
    timeout: float = 60.0,
    config: Mapping[str, Any] | None = None,
) -> Iterator[Any]:
    """Every record of a topic, read by an independent consumer with no group (assign + end offsets).

    Reads until each partition's position reaches the high watermark (or the last stable offset
    under read_committed) seen at the start, so transaction markers and gaps cannot stall it.
    `config` adds client settings (a secured cluster's `client_config()`).
    """
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {
            **(config or {}),
            "bootstrap.servers": bootstrap_servers,
            "group.id": f"rk-reader-{uuid.uuid4()}",
            "enable.auto.commit": False,
            "isolation.level": isolation_level,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
        }
    )
    try:
        md = consumer.list_topics(topic, timeout=10)
        parts = sorted(md.topics[topic].partitions)
        ends: dict[int, int] = {}
        for p in parts:
            _low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)
            ends[p] = high
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        deadline = time.monotonic() + timeout
        pending = {p for p in parts if ends[p] > 0}
        while pending and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                yield msg
            # Position, not the last message, tells when a partition is done: markers occupy offsets.
            for tp in consumer.position([TopicPartition(topic, p) for p in list(pending)]):
                if tp.offset >= ends[tp.partition]:
                    pending.discard(tp.partition)
        if pending:
            raise ClusterError(f"reading {topic} timed out; partitions {sorted(pending)} did not reach their end")
    finally:
        consumer.close()

