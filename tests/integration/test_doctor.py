"""`reliable-kafka doctor` against a deliberately misconfigured real cluster and a healthy one."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from click.testing import CliRunner
from confluent_kafka import Consumer, Producer, TopicPartition

from reliable_kafka.admin import admin_client
from reliable_kafka.cli.main import cli
from reliable_kafka.doctor import CRITICAL, diagnose
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.testing import LocalKafkaCluster
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS
from tests.fixtures.kafka import _require_kafka

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def weak_cluster() -> Iterator[LocalKafkaCluster]:
    """Seed 003's settings: internal topics with one replica, plus weak topics.

    One broker is enough for every trap the doctor reads from configs (it judges the settings, not
    how many brokers hold them), and it starts one JVM beside the suite's two clusters instead of three.
    """
    _require_kafka()
    cluster = LocalKafkaCluster(brokers=1, jvm_options=QUICK_START_JVM_OPTIONS, broker_config={
        "offsets.topic.replication.factor": 1,
        "transaction.state.log.replication.factor": 1,
        "transaction.state.log.min.isr": 1,
    })
    cluster.start()
    try:
        cluster.wait_healthy()
        cluster.create_topic("rf1", 1, 1)
        cluster.create_topic("isr1", 1, 1, {"min.insync.replicas": 1})
        cluster.create_topic("unclean", 1, 1, {"unclean.leader.election.enable": True})
        # Use a group and a transaction so the internal topics exist with their weak settings.
        c = Consumer({"bootstrap.servers": cluster.bootstrap_servers, "group.id": "doctor-probe"})
        # The first commit on a fresh broker can meet COORDINATOR_LOAD_IN_PROGRESS while
        # __consumer_offsets loads: retried as the library retries it, not left to chance.
        retry_kafka_call(lambda: c.commit(offsets=[TopicPartition("isr1", 0, 0)], asynchronous=False),
                         deadline_s=60, what="doctor probe commit")
        c.close()
        p = Producer({"bootstrap.servers": cluster.bootstrap_servers, "transactional.id": "doctor-probe"})
        p.init_transactions(30)
        yield cluster
    finally:
        cluster.stop()


def test_doctor_flags_every_trap_as_critical(weak_cluster: LocalKafkaCluster) -> None:
    findings = diagnose(admin_client(weak_cluster.bootstrap_servers))
    critical = {(f.check, f.subject) for f in findings if f.severity == CRITICAL}
    assert ("replication-factor", "rf1") in critical
    assert ("min-insync-replicas", "isr1") in critical
    assert ("unclean-leader-election", "unclean") in critical
    assert ("replication-factor", "__consumer_offsets") in critical
    assert ("replication-factor", "__transaction_state") in critical
    assert any(check == "offsets.topic.replication.factor" for check, _ in critical)
    assert any(check == "transaction.state.log.min.isr" for check, _ in critical)


def test_doctor_cli_exits_2_with_json_findings(weak_cluster: LocalKafkaCluster) -> None:
    result = CliRunner().invoke(cli, ["doctor", "--bootstrap-servers", weak_cluster.bootstrap_servers, "--json"])
    assert result.exit_code == 2, result.output
    data = json.loads(result.stdout)
    assert {"severity", "check", "subject", "detail", "fix"} <= set(data["findings"][0])
    assert any(f["severity"] == "critical" and f["subject"] == "rf1" for f in data["findings"])


def test_doctor_finds_nothing_critical_on_a_healthy_cluster(kafka: LocalKafkaCluster) -> None:
    topic = f"healthy-{uuid.uuid4().hex[:6]}"
    kafka.create_topic(topic, 3, 3)
    findings = diagnose(admin_client(kafka.bootstrap_servers))
    # The shared cluster also holds other tests' deliberately weak topics: judge the cluster-wide
    # settings, the internal topics and our own topic.
    ours = [f for f in findings if not f.subject.startswith(("t-", "lab-")) or f.subject == topic]
    assert [f for f in ours if f.severity == CRITICAL] == []
    assert any(f.subject == topic and f.severity == "ok" for f in ours)
    # Every broker-level check that passed is listed as such, so a clean report says what it checked.
    passed = {f.check for f in findings if f.severity == "ok" and f.subject.startswith("broker ")}
    assert {"offsets.topic.replication.factor", "transaction.state.log.replication.factor",
            "transaction.state.log.min.isr", "unclean.leader.election.enable", "min.insync.replicas"} <= passed


def test_doctor_all_lists_the_checks_that_passed(kafka: LocalKafkaCluster) -> None:
    result = CliRunner().invoke(cli, ["doctor", "--bootstrap-servers", kafka.bootstrap_servers, "--all"])
    assert result.exit_code in (0, 2), result.output  # 2 if other tests' weak topics are on the shared cluster
    for check in ("brokers", "unclean.leader.election.enable", "transaction.state.log.min.isr"):
        assert check in result.stdout
