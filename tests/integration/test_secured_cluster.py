"""LocalKafkaCluster(security="sasl-plain"): real SASL/PLAIN authentication and real ACLs (Kafka's
StandardAuthorizer) on the real jars. A wrong password is refused, a principal without ACLs sees and
writes nothing, and the same principal produces once it is granted Describe and Write."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from reliable_kafka import ReliableProducer, TopicAuthorizationFailed, TopicMissing
from reliable_kafka.doctor import diagnose
from reliable_kafka.testing import LocalKafkaCluster
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS, consume_all
from tests.fixtures.kafka import _require_kafka

pytestmark = pytest.mark.cluster

ALICE = "alice-" + uuid.uuid4().hex[:6]


@pytest.fixture(scope="module")
def secured() -> Iterator[LocalKafkaCluster]:
    """One node is enough: authentication and authorization happen on every broker alike."""
    _require_kafka()
    cluster = LocalKafkaCluster(brokers=1, jvm_options=QUICK_START_JVM_OPTIONS, security="sasl-plain",
                                users={ALICE: uuid.uuid4().hex})
    cluster.start()
    try:
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.stop()


def _send_one(conf: dict[str, object], topic: str, value: bytes) -> KafkaError | None:
    outcome: list[KafkaError | None] = []
    p = Producer({**conf, "message.timeout.ms": 10_000, "enable.idempotence": True, "acks": "all"})
    p.produce(topic, value, on_delivery=lambda err, msg: outcome.append(err))
    p.flush(20)
    return outcome[0] if outcome else KafkaError(KafkaError._TIMED_OUT)


def test_the_harness_itself_is_the_super_user_and_its_secrets_stay_out_of_repr_and_state(
    secured: LocalKafkaCluster,
) -> None:
    topic = f"s-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    assert _send_one(secured.client_config(), topic, b"from-admin") is None
    got = [m.value() for m in consume_all(secured.bootstrap_servers, topic, config=secured.client_config())]
    assert got == [b"from-admin"]
    shown = repr(secured) + str(secured.describe())
    assert secured.client_config()["sasl.password"] not in shown
    assert secured.client_config(ALICE)["sasl.password"] not in shown
    assert secured.describe()["security"] == "sasl-plain"


def test_a_wrong_password_is_refused(secured: LocalKafkaCluster) -> None:
    conf = {**secured.client_config(ALICE), "sasl.password": "not-" + uuid.uuid4().hex}
    errors: list[KafkaError] = []
    p = Producer({**conf, "socket.timeout.ms": 5000, "error_cb": errors.append})
    with pytest.raises(KafkaException):  # no metadata: the broker closed the connection
        p.list_topics(timeout=10)
    p.poll(1)  # serves error_cb: the reason is reported there
    assert KafkaError._AUTHENTICATION in {e.code() for e in errors}, errors


def test_a_principal_without_acls_is_denied_until_granted_describe_and_write(secured: LocalKafkaCluster) -> None:
    topic = f"s-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    alice = secured.client_config(ALICE)
    denied = _send_one(alice, topic, b"denied")
    assert denied is not None and denied.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, denied

    grants = [AclBinding(ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{ALICE}", "*", op,
                         AclPermissionType.ALLOW) for op in (AclOperation.DESCRIBE, AclOperation.WRITE)]
    for future in secured.admin().create_acls(grants).values():
        future.result(timeout=30)
    # ACLs reach the broker through the metadata log: the first send after the grant may still be denied.
    outcome = None
    for _ in range(10):
        outcome = _send_one(alice, topic, b"granted")
        if outcome is None:
            break
    assert outcome is None, outcome
    got = [m.value() for m in consume_all(secured.bootstrap_servers, topic, config=secured.client_config())]
    assert b"granted" in got and b"denied" not in got


def test_a_topic_the_principal_may_not_describe_is_refused_as_denied_naming_the_grant_not_as_missing(
    secured: LocalKafkaCluster, tmp_path
) -> None:
    topic = f"s-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    with (ReliableProducer(secured.client_config(ALICE), outbox_path=tmp_path / "o.db") as producer,
          pytest.raises(TopicAuthorizationFailed) as denied):
        producer.send(topic, b"never accepted")
    assert denied.value.topic == topic and denied.value.operation == "Describe"
    assert "kafka-acls" in str(denied.value) and "--operation Describe" in str(denied.value)
    assert not isinstance(denied.value, TopicMissing)


def test_doctor_as_a_principal_that_may_not_describe_a_topic_warns_instead_of_failing(
    secured: LocalKafkaCluster,
) -> None:
    topic = f"s-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    grants = [AclBinding(ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{ALICE}", "*",
                         AclOperation.DESCRIBE, AclPermissionType.ALLOW)]
    for future in secured.admin().create_acls(grants).values():
        future.result(timeout=30)
    admin = AdminClient(secured.client_config(ALICE))
    deadline = time.monotonic() + 30  # the ACL reaches the broker through the metadata log
    while topic not in admin.list_topics(timeout=10).topics and time.monotonic() < deadline:
        time.sleep(0.2)
    report = diagnose(admin)
    findings = [f for f in report if f.subject == topic]
    assert [(f.severity, f.check) for f in findings] == [("warning", "authorization")], findings
    assert "DescribeConfigs" in findings[0].detail
    # The broker settings need DescribeConfigs on the cluster: not checked, said so, never "unreachable".
    brokers = [f for f in report if f.subject.startswith("broker ")]
    assert [(f.severity, f.check) for f in brokers] == [("warning", "authorization")], brokers
