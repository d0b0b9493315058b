"""Cluster audit behind `reliable-kafka doctor`: the replication traps of the seeds, found and explained.

Every finding names what it checked, on what, what is wrong and how to fix it; a critical finding
means an acknowledged write can be lost or consumers can stop (failure modes L1, L2, L3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from confluent_kafka.admin import AdminClient

from reliable_kafka.admin import (
    MIN_INSYNC_REPLICAS,
    MIN_REPLICATION_FACTOR,
    broker_configs,
    describe_topic,
    no_answer,
)
from reliable_kafka.errors import ClusterAuthorizationFailed, TopicAuthorizationFailed

CRITICAL, WARNING, OK = "critical", "warning", "ok"
INTERNAL_TOPICS = {
    "__consumer_offsets": ("offsets.topic.replication.factor", None),
    "__transaction_state": ("transaction.state.log.replication.factor", "transaction.state.log.min.isr"),
}


@dataclass(frozen=True)
class Finding:
    severity: str
    check: str
    subject: str
    detail: str
    fix: str

    def as_json(self) -> dict[str, str]:
        return asdict(self)


def _topic_findings(admin: AdminClient, topic: str, live: int, timeout: float) -> list[Finding]:
    try:
        d = describe_topic(admin, topic, timeout)
    except TopicAuthorizationFailed as exc:
        return [Finding(WARNING, "authorization", topic,
                        f"this principal may not {exc.operation} the topic, so its settings were not checked",
                        f"grant Describe and DescribeConfigs on topic {topic} to the principal doctor runs as")]
    if d is None:
        return []
    out = []
    rf, isr = d.replication_factor, d.min_insync_replicas
    internal = topic in INTERNAL_TOPICS
    if rf < 2 or (internal and rf < MIN_REPLICATION_FACTOR):
        out.append(Finding(CRITICAL, "replication-factor", topic,
                           f"replication factor {rf}: one broker down makes it unavailable and a disk loss "
                           + ("stops every consumer group / transaction (failure mode L3)" if internal else "loses it"),
                           "raise it to 3 with kafka-reassign-partitions"
                           + (" and set the broker's " + INTERNAL_TOPICS[topic][0] + "=3" if internal else "")))
    elif rf < MIN_REPLICATION_FACTOR:
        out.append(Finding(WARNING, "replication-factor", topic,
                           f"replication factor {rf}: min.insync.replicas=2 then stops writes when one broker "
                           "is down", "raise it to 3 with kafka-reassign-partitions"))
    if rf > live:
        out.append(Finding(CRITICAL, "live-brokers", topic,
                           f"replication factor {rf} but only {live} broker(s) are alive: partitions are "
                           "under-replicated", "bring the missing brokers back"))
    if not internal or topic == "__transaction_state":
        if isr < MIN_INSYNC_REPLICAS:
            out.append(Finding(CRITICAL, "min-insync-replicas", topic,
                               f"min.insync.replicas={isr}: acks=all is satisfied by the leader alone, so a "
                               "leader failure loses acknowledged writes (failure mode L2)",
                               f"kafka-configs --alter --entity-type topics --entity-name {topic} "
                               "--add-config min.insync.replicas=2"))
        elif isr >= rf > 1:
            out.append(Finding(WARNING, "min-insync-replicas", topic,
                               f"min.insync.replicas={isr} >= replication factor {rf}: any broker down stops "
                               "acks=all writes", "use replication factor 3 with min.insync.replicas=2"))
    if d.unclean_leader_election:
        out.append(Finding(CRITICAL, "unclean-leader-election", topic,
                           "unclean.leader.election.enable=true: an out-of-sync replica can become leader and "
                           "truncate acknowledged records",
                           f"kafka-configs --alter --entity-type topics --entity-name {topic} "
                           "--add-config unclean.leader.election.enable=false"))
    if not out:
        out.append(Finding(OK, "durability", topic,
                           f"replication factor {rf}, min.insync.replicas={isr}, unclean election off", ""))
    return out


def diagnose(admin: AdminClient, *, timeout: float = 10.0, include_ok: bool = True) -> list[Finding]:
    """Audit a cluster; raises ClusterUnreachable when no broker answers, AuthenticationFailed when the
    brokers refuse the login."""
    try:
        md = admin.list_topics(timeout=timeout)
    except Exception as exc:
        raise no_answer(admin, f"no broker answered within {timeout:.0f}s", exc) from exc
    live = len(md.brokers)
    findings: list[Finding] = []
    findings.append(Finding(OK, "brokers", "cluster", f"{live} broker(s) registered", ""))
    # Broker defaults for the internal topics, which may not exist yet (they are created on first use).
    any_broker = sorted(md.brokers)[0]
    try:
        findings += _broker_findings(broker_configs(admin, any_broker, timeout), any_broker)
    except ClusterAuthorizationFailed:
        findings.append(Finding(WARNING, "authorization", f"broker {any_broker}",
                                "this principal may not DescribeConfigs on the cluster, so the broker settings "
                                "were not checked", "grant DescribeConfigs on the cluster to the principal doctor "
                                "runs as (kafka-acls.sh --add --operation DescribeConfigs --cluster)"))
    for name, t in sorted(md.topics.items()):
        offline = [p for p, pm in t.partitions.items() if pm.leader < 0]
        if offline:
            findings.append(Finding(CRITICAL, "offline-partitions", name,
                                    f"partitions {offline[:10]} have no leader", "bring their replicas back"))
        under = [p for p, pm in t.partitions.items() if pm.leader >= 0 and set(pm.isrs) != set(pm.replicas)]
        if under:
            findings.append(Finding(WARNING, "under-replicated", name,
                                    f"partitions {under[:10]} have fewer in-sync replicas than replicas",
                                    "check the lagging brokers"))
        findings += _topic_findings(admin, name, live, timeout)
    return findings if include_ok else [f for f in findings if f.severity != OK]


def _broker_findings(bconf: dict[str, Any], any_broker: int) -> list[Finding]:
    """The broker settings' checks: defaults for the internal topics and for every topic."""
    findings: list[Finding] = []
    for topic, (rf_key, isr_key) in INTERNAL_TOPICS.items():
        rf = int(bconf.get(rf_key, "3"))
        if rf < MIN_REPLICATION_FACTOR:
            findings.append(Finding(CRITICAL, rf_key, f"broker {any_broker}",
                                    f"{rf_key}={rf}: {topic} is created with {rf} replica(s); one broker down "
                                    "stops every consumer group / transaction (failure mode L3)",
                                    f"set {rf_key}=3 on every broker (before {topic} is created)"))
        else:  # every check that passed is listed too (doctor --all), so a clean report says what it checked
            findings.append(Finding(OK, rf_key, f"broker {any_broker}", f"{rf_key}={rf}: {topic} is created with "
                                    f"{rf} replicas", ""))
        if isr_key is not None and int(bconf.get(isr_key, "2")) < MIN_INSYNC_REPLICAS:
            findings.append(Finding(CRITICAL, isr_key, f"broker {any_broker}",
                                    f"{isr_key}={bconf.get(isr_key)}: transaction state is acknowledged by one "
                                    "replica", f"set {isr_key}=2 on every broker"))
        elif isr_key is not None:
            findings.append(Finding(OK, isr_key, f"broker {any_broker}", f"{isr_key}={bconf.get(isr_key, '2')}", ""))
    if str(bconf.get("unclean.leader.election.enable", "false")).lower() == "true":
        findings.append(Finding(CRITICAL, "unclean.leader.election.enable", f"broker {any_broker}",
                                "unclean election is on by default for every topic",
                                "set unclean.leader.election.enable=false on every broker"))
    else:
        findings.append(Finding(OK, "unclean.leader.election.enable", f"broker {any_broker}",
                                "unclean election is off by default", ""))
    if int(bconf.get("min.insync.replicas", "1")) < MIN_INSYNC_REPLICAS:
        findings.append(Finding(WARNING, "min.insync.replicas", f"broker {any_broker}",
                                f"the broker default min.insync.replicas={bconf.get('min.insync.replicas')} "
                                "applies to every topic that does not override it",
                                "set min.insync.replicas=2 on every broker"))
    else:
        findings.append(Finding(OK, "min.insync.replicas", f"broker {any_broker}",
                                f"the broker default min.insync.replicas={bconf.get('min.insync.replicas')}", ""))
    return findings
