"""Topic and cluster inspection shared by the producer's preflight and `reliable-kafka doctor`.

One place decides whether a topic can keep an acks=all write durable: replication factor >= 3,
min.insync.replicas >= 2 and unclean leader election off (failure modes L1, L2).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource

from reliable_kafka.errors import ClusterUnreachable, TopicConfigError
from reliable_kafka.retry import retry_kafka_call

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("reliable_kafka.rdkafka")

MIN_REPLICATION_FACTOR = 3
MIN_INSYNC_REPLICAS = 2


@dataclass(frozen=True)
class TopicDurability:
    """What a topic's replication settings promise for an acks=all write."""

    topic: str
    partitions: int
    replication_factor: int
    min_insync_replicas: int
    unclean_leader_election: bool
    max_message_bytes: int

    def problems(self) -> list[str]:
        """Why an acknowledged write could still be lost on this topic (empty when it cannot)."""
        found = []
        if self.replication_factor < MIN_REPLICATION_FACTOR:
            found.append(
                f"replication factor {self.replication_factor} < {MIN_REPLICATION_FACTOR}: "
                "one broker failure leaves no spare copy"
            )
        if self.min_insync_replicas < MIN_INSYNC_REPLICAS:
            found.append(
                f"min.insync.replicas={self.min_insync_replicas} < {MIN_INSYNC_REPLICAS}: "
                "acks=all is then satisfied by the leader alone, which is acks=1"
            )
        if self.unclean_leader_election:
            found.append(
                "unclean.leader.election.enable=true: an out-of-sync replica may become leader and "
                "truncate acknowledged records"
            )
        return found


def admin_client(bootstrap_servers: str, extra: Mapping[str, Any] | None = None) -> AdminClient:
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap_servers, "socket.timeout.ms": 10_000,
                            "logger": _rdkafka_log}
    conf.update(extra or {})
    return AdminClient(conf)


def describe_topic(admin: AdminClient, topic: str, timeout: float = 10.0) -> TopicDurability | None:
    """The durability settings of a topic, or None if it does not exist.

    Raises ClusterUnreachable when no broker answers within `timeout`.
    """
    try:
        md = admin.list_topics(topic, timeout=timeout)
    except KafkaException as exc:
        raise ClusterUnreachable(f"no broker answered a metadata request within {timeout:.0f}s: {exc}") from exc
    t = md.topics.get(topic)
    if t is None or t.error is not None or not t.partitions:
        return None
    rf = min(len(p.replicas) for p in t.partitions.values())
    configs = topic_configs(admin, topic, timeout)
    return TopicDurability(
        topic=topic,
        partitions=len(t.partitions),
        replication_factor=rf,
        min_insync_replicas=int(configs.get("min.insync.replicas", "1")),
        unclean_leader_election=configs.get("unclean.leader.election.enable", "false").lower() == "true",
        max_message_bytes=int(configs.get("max.message.bytes", "1048588")),
    )


def topic_configs(admin: AdminClient, topic: str, timeout: float = 10.0) -> dict[str, str]:
    """The effective configuration of a topic (its own overrides and the broker defaults)."""
    res = ConfigResource(ConfigResource.Type.TOPIC, topic)
    try:
        # A topic just created can be unknown for a moment to the broker that answers: retry
        # retriable errors (UNKNOWN_TOPIC_OR_PART, leader moves) within the same timeout.
        entries = retry_kafka_call(
            lambda: admin.describe_configs([res], request_timeout=timeout)[res].result(timeout=timeout),
            deadline_s=timeout,
            what=f"configuration of topic {topic!r}",
        )
    except (KafkaException, concurrent.futures.TimeoutError) as exc:
        raise ClusterUnreachable(f"could not read the configuration of topic {topic!r}: {exc}") from exc
    return {k: v.value for k, v in entries.items() if v.value is not None}


def broker_configs(admin: AdminClient, broker_id: int, timeout: float = 10.0) -> dict[str, str]:
    res = ConfigResource(ConfigResource.Type.BROKER, str(broker_id))
    try:
        entries = admin.describe_configs([res], request_timeout=timeout)[res].result(timeout=timeout)
    except (KafkaException, concurrent.futures.TimeoutError) as exc:
        raise ClusterUnreachable(f"could not read the configuration of broker {broker_id}: {exc}") from exc
    return {k: v.value for k, v in entries.items() if v.value is not None}


def preflight(admin: AdminClient, topic: str, *, mode: str = "error", timeout: float = 10.0) -> TopicDurability | None:
    """Check that `topic` can keep acks=all writes durable.

    mode "error" raises TopicConfigError, "warn" logs a warning, "off" only describes the topic.
    A topic that does not exist yet returns None: the producer's delivery report will say so.
    """
    if mode not in ("error", "warn", "off"):
        raise ValueError(f"preflight must be 'error', 'warn' or 'off', not {mode!r}")
    durability = describe_topic(admin, topic, timeout)
    if durability is None:
        return None
    problems = durability.problems()
    if problems and mode != "off":
        if mode == "error":
            raise TopicConfigError(topic, problems)
        log.warning("topic %r cannot keep acks=all durable: %s", topic, "; ".join(problems))
    return durability
