"""Topic and cluster inspection shared by the producer's preflight and `reliable-kafka doctor`.

One place decides whether a topic can keep an acks=all write durable: replication factor >= 3,
min.insync.replicas >= 2 and unclean leader election off (failure modes L1, L2).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from reliable_kafka.config import connection_settings
from reliable_kafka.errors import (
    AuthenticationFailed,
    ClusterAuthorizationFailed,
    ClusterUnreachable,
    ConfigError,
    TopicAuthorizationFailed,
    TopicConfigError,
)
from reliable_kafka.kafka_errors import code_of
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
        found = _replication_problems(self.replication_factor)
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


def _replication_problems(replication_factor: int) -> list[str]:
    if replication_factor < MIN_REPLICATION_FACTOR:
        return [f"replication factor {replication_factor} < {MIN_REPLICATION_FACTOR}: "
                "one broker failure leaves no spare copy"]
    return []


class _Admin(AdminClient):
    """An AdminClient that keeps the brokers' refusal of its login (its error_cb sees it; a request
    that then gets no answer only says "transport failure"), so callers can say "credentials", not
    "unreachable"."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.login_refused: str | None = None
        self.username, self.mechanism = conf.get("sasl.username"), conf.get("sasl.mechanism")
        conf["error_cb"] = self._on_error
        super().__init__(conf)

    def _on_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._AUTHENTICATION:
            self.login_refused = str(err.str())


def admin_client(bootstrap_servers: str, extra: Mapping[str, Any] | None = None) -> AdminClient:
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap_servers, "socket.timeout.ms": 10_000,
                            "logger": _rdkafka_log}
    conf.update(extra or {})
    return _Admin(conf)


def no_answer(admin: AdminClient, what: str, exc: BaseException) -> AuthenticationFailed | ClusterUnreachable:
    """The error for a request nobody answered: a refused login when the client saw one, else unreachable."""
    if isinstance(admin, _Admin):
        with contextlib.suppress(KafkaException, RuntimeError):
            admin.poll(0)  # serves the error_cb with what the client saw meanwhile
        if admin.login_refused is not None:
            return AuthenticationFailed(admin.username, admin.mechanism, admin.login_refused)
    return ClusterUnreachable(f"{what}: {exc}")


def describe_topic(admin: AdminClient, topic: str, timeout: float = 10.0) -> TopicDurability | None:
    """The durability settings of a topic, or None if it does not exist.

    Raises ClusterUnreachable when no broker answers within `timeout`, TopicAuthorizationFailed when the
    principal may not Describe the topic or read its configuration (DescribeConfigs).
    """
    replication = _replication(admin, topic, timeout)
    if replication is None:
        return None
    partitions, rf = replication
    configs = topic_configs(admin, topic, timeout)
    return TopicDurability(
        topic=topic,
        partitions=partitions,
        replication_factor=rf,
        min_insync_replicas=int(configs.get("min.insync.replicas", "1")),
        unclean_leader_election=configs.get("unclean.leader.election.enable", "false").lower() == "true",
        max_message_bytes=int(configs.get("max.message.bytes", "1048588")),
    )


def partition_count(admin: AdminClient, topic: str, timeout: float = 10.0) -> int | None:
    """How many partitions `topic` has; None if it does not exist. TopicAuthorizationFailed when the
    principal may not describe it, ClusterUnreachable when no broker answers."""
    replication = _replication(admin, topic, timeout)
    return replication[0] if replication is not None else None


def _replication(admin: AdminClient, topic: str, timeout: float) -> tuple[int, int] | None:
    """(partitions, lowest replication factor) from the metadata, which Describe alone may read; None
    if the topic does not exist."""
    try:
        md = admin.list_topics(topic, timeout=timeout)
    except KafkaException as exc:
        raise no_answer(admin, f"no broker answered a metadata request within {timeout:.0f}s", exc) from exc
    t = md.topics.get(topic)
    if t is not None and t.error is not None and t.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        # The broker hides a topic the principal may not describe: denied, not missing.
        raise TopicAuthorizationFailed(topic, "Describe")
    if t is None or t.error is not None or not t.partitions:
        return None
    return len(t.partitions), min(len(p.replicas) for p in t.partitions.values())


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
        if isinstance(exc, KafkaException) and code_of(exc) == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise TopicAuthorizationFailed(topic, "DescribeConfigs") from exc
        raise ClusterUnreachable(f"could not read the configuration of topic {topic!r}: {exc}") from exc
    return {k: v.value for k, v in entries.items() if v.value is not None}


def broker_configs(admin: AdminClient, broker_id: int, timeout: float = 10.0) -> dict[str, str]:
    res = ConfigResource(ConfigResource.Type.BROKER, str(broker_id))
    try:
        entries = admin.describe_configs([res], request_timeout=timeout)[res].result(timeout=timeout)
    except (KafkaException, concurrent.futures.TimeoutError) as exc:
        if isinstance(exc, KafkaException) and code_of(exc) == KafkaError.CLUSTER_AUTHORIZATION_FAILED:
            raise ClusterAuthorizationFailed("DescribeConfigs") from exc
        raise ClusterUnreachable(f"could not read the configuration of broker {broker_id}: {exc}") from exc
    return {k: v.value for k, v in entries.items() if v.value is not None}


def preflight(admin: AdminClient, topic: str, *, mode: str = "error", timeout: float = 10.0) -> TopicDurability | None:
    """Check that `topic` can keep acks=all writes durable.

    mode "error" raises TopicConfigError, "warn" logs a warning, "off" only describes the topic.
    A topic that does not exist yet returns None: the producer's delivery report will say so.
    A principal that may Describe the topic but not read its configuration (a producer granted
    Describe and Write, as `kafka-acls --producer` does) gets the replication factor checked and a
    warning that the rest was not; None is returned (the size limit is learnt from the broker).
    """
    if mode not in ("error", "warn", "off"):
        raise ValueError(f"preflight must be 'error', 'warn' or 'off', not {mode!r}")
    try:
        durability = describe_topic(admin, topic, timeout)
    except AuthenticationFailed:
        if mode == "off":  # "off" describes what it may, and checks nothing
            return None
        raise
    except TopicAuthorizationFailed as exc:
        if mode == "off":
            return None
        if exc.operation != "DescribeConfigs":
            raise
        replication = _replication(admin, topic, timeout)
        problems = _replication_problems(replication[1]) if replication is not None else []
        if problems and mode == "error":
            raise TopicConfigError(topic, problems) from exc
        log.warning("topic %r: min.insync.replicas and unclean.leader.election.enable were not checked "
                    "(%s)%s", topic, exc, "; " + "; ".join(problems) if problems else "")
        return None
    if durability is None:
        return None
    problems = durability.problems()
    if problems and mode != "off":
        if mode == "error":
            raise TopicConfigError(topic, problems)
        log.warning("topic %r cannot keep acks=all durable: %s", topic, "; ".join(problems))
    return durability


def ensure_topic(config: Mapping[str, Any], topic: str, *, partitions: int = 3,
                 replication_factor: int | None = None, min_insync_replicas: int | None = None,
                 timeout: float = 30.0) -> TopicDurability:
    """Create `topic` with settings that keep acks=all durable, unless it exists; returns what it has.

    `config` is a client configuration (only its connection settings are used). A new topic gets
    replication factor 3 and min.insync.replicas 2, or as much as the cluster can hold: on fewer than
    3 brokers it is created with what there is, and a WARNING says the preflight will refuse it. An
    existing topic is left as it is (never altered): its problems, if any, are logged at WARNING.

    Raises ClusterUnreachable when no broker answers, ConfigError for impossible settings.
    """
    if "bootstrap.servers" not in config:
        raise ConfigError("bootstrap.servers", "ensure_topic needs the brokers' addresses")
    admin = admin_client(config["bootstrap.servers"], connection_settings(config))
    existing = describe_topic(admin, topic, timeout)
    if existing is not None:
        if existing.problems():
            log.warning("topic %r exists and cannot keep acks=all durable: %s", topic, "; ".join(existing.problems()))
        return existing
    try:
        brokers = len(admin.list_topics(timeout=timeout).brokers)
    except KafkaException as exc:
        raise no_answer(admin, f"no broker answered a metadata request within {timeout:.0f}s", exc) from exc
    rf = replication_factor if replication_factor is not None else min(MIN_REPLICATION_FACTOR, brokers)
    isr = min_insync_replicas if min_insync_replicas is not None else min(MIN_INSYNC_REPLICAS, rf)
    if not 1 <= isr <= rf <= brokers:
        raise ConfigError("replication_factor", f"topic {topic!r}: replication factor {rf} and min.insync.replicas "
                          f"{isr} do not fit a cluster of {brokers} broker(s) (need 1 <= min ISR <= RF <= brokers)")
    future = admin.create_topics([NewTopic(topic, partitions, rf, config={"min.insync.replicas": str(isr)})],
                                 operation_timeout=timeout)[topic]
    try:
        future.result(timeout)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # created meanwhile by someone else: fine
            raise
    created = None
    deadline = time.monotonic() + timeout
    while created is None:  # a new topic reaches every broker's metadata a moment after it is created
        if time.monotonic() > deadline:
            raise ClusterUnreachable(f"topic {topic!r} was created but did not appear in metadata in {timeout:.0f}s")
        time.sleep(0.1)
        created = describe_topic(admin, topic, timeout)
    if created.problems():
        log.warning("created topic %r with what a %d-broker cluster can hold, which cannot keep acks=all durable: "
                    "%s; the producer's preflight will refuse it (preflight='warn' to proceed)", topic, brokers,
                    "; ".join(created.problems()))
    else:
        log.info("created topic %r: %d partitions, replication factor %d, min.insync.replicas %d", topic,
                 partitions, rf, isr)
    return created
