"""LocalKafkaCluster(security="sasl-scram+tls"): real SASL/SCRAM-SHA-512 over TLS and real ACLs (Kafka's
StandardAuthorizer) on the real jars (SASL/PLAIN: tests/integration/test_cli_secured.py). A wrong password
is refused as such, a principal without ACLs sees and writes nothing, and what it sent is delivered once
it is granted Describe and Write. The loss lab's producer crash runs on the same cluster: its verdict holds
there as on the open cluster."""

from __future__ import annotations

import logging
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

from reliable_kafka import (
    AuthenticationFailed,
    ClusterUnreachable,
    ReliableConsumer,
    ReliableProducer,
    TopicAuthorizationFailed,
    TopicConfigError,
    TopicMissing,
)
from reliable_kafka.admin import admin_client
from reliable_kafka.doctor import diagnose
from reliable_kafka.lab.base import CONTROL, RELIABLE, no_progress
from reliable_kafka.lab.producer_scenarios import producer_crash
from reliable_kafka.testing import LocalKafkaCluster
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS, consume_all
from tests.fixtures.kafka import _require_kafka

pytestmark = pytest.mark.cluster

ALICE = "alice-" + uuid.uuid4().hex[:6]
SENTINEL = "sentinel-" + uuid.uuid4().hex  # ALICE's password: grepped for in everything a run writes


@pytest.fixture(scope="module")
def secured() -> Iterator[LocalKafkaCluster]:
    """One node is enough: authentication and authorization happen on every broker alike. SCRAM over TLS
    (SASL_SSL), as production clusters run."""
    _require_kafka()
    with LocalKafkaCluster(brokers=1, jvm_options=QUICK_START_JVM_OPTIONS, security="sasl-scram+tls",
                           users={ALICE: SENTINEL}) as cluster:
        cluster.wait_healthy()
        yield cluster


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
    assert secured.describe()["security"] == "sasl-scram+tls"
    assert secured.client_config()["security.protocol"] == "SASL_SSL"
    # The listener's certificate chains to the run's CA and names 127.0.0.1 (checked as a client checks it).
    import socket
    import ssl

    host, port = secured.bootstrap_servers.split(",")[0].rsplit(":", 1)
    context = ssl.create_default_context(cafile=secured.client_config()["ssl.ca.location"])
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        cert = tls.getpeercert()
    assert dict(field[0] for field in cert["issuer"])["commonName"] == "reliable-kafka test CA"
    assert dict(field[0] for field in cert["subject"])["commonName"] == "localhost"


def test_a_wrong_password_is_refused_as_such_never_as_unreachable_and_never_shown(
    secured: LocalKafkaCluster, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = "not-" + uuid.uuid4().hex
    conf = {**secured.client_config(ALICE), "sasl.password": wrong, "socket.timeout.ms": 5000}
    caplog.set_level(logging.DEBUG, logger="reliable_kafka")
    # The control: bare librdkafka only says "transport failure"; the reason goes to error_cb.
    errors: list[KafkaError] = []
    p = Producer({**conf, "error_cb": errors.append})
    with pytest.raises(KafkaException):
        p.list_topics(timeout=2)
    p.poll(1)
    assert KafkaError._AUTHENTICATION in {e.code() for e in errors}, errors

    with pytest.raises(AuthenticationFailed) as refused:
        diagnose(admin_client(secured.bootstrap_servers, {k: v for k, v in conf.items() if k != "bootstrap.servers"}),
                 timeout=2)
    assert refused.value.username == ALICE and refused.value.mechanism == "SCRAM-SHA-512"
    topic = f"s-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    with (ReliableProducer(conf, outbox_path=tmp_path / "o.db") as producer,
          pytest.raises(AuthenticationFailed) as at_send):
        producer.send(topic, b"never accepted")
    assert "sasl.password" in str(at_send.value) and not isinstance(at_send.value, ClusterUnreachable)
    # Accepted without a preflight, a message stays pending while the login is refused; said once.
    producer = ReliableProducer(conf, outbox_path=tmp_path / "p.db", preflight="off")
    try:
        producer.send(topic, b"kept")
        _wait_for(lambda: "refused to authenticate" in caplog.text, "the refused login")
        assert producer.pending == 1 and producer.stats().failed == 0
    finally:
        assert producer.close(timeout=0.5) == 1  # still pending: kept in the outbox, not lost
    assert caplog.text.count("refused to authenticate") == 2  # the send's preflight, then the producer once
    shown = caplog.text + str(refused.value) + str(at_send.value)
    assert wrong not in shown


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


def _grant(cluster: LocalKafkaCluster, user: str, topic: str, *ops: AclOperation) -> None:
    bindings = [AclBinding(ResourceType.TOPIC, topic, ResourcePatternType.LITERAL, f"User:{user}", "*", op,
                           AclPermissionType.ALLOW) for op in ops]
    for future in cluster.admin().create_acls(bindings).values():
        future.result(timeout=30)


def _wait_for(condition, what: str, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_messages_to_a_topic_the_principal_may_not_write_stay_pending_until_granted_then_all_arrive(
    secured: LocalKafkaCluster, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Write on one topic (so the idempotent producer gets its producer id), Describe only on the other:
    the second topic's messages are held, pending, while the first one's flow; granted, all arrive."""
    allowed, denied = f"s-{uuid.uuid4().hex[:8]}", f"s-{uuid.uuid4().hex[:8]}"
    for topic in (allowed, denied):
        secured.create_topic(topic, 1, 1)
    _grant(secured, ALICE, allowed, AclOperation.DESCRIBE, AclOperation.WRITE)
    _grant(secured, ALICE, denied, AclOperation.DESCRIBE)
    alice = secured.client_config(ALICE)
    caplog.set_level(logging.INFO, logger="reliable_kafka.producer")
    # The control: a bare idempotent producer, same principal and settings, loses what it sent there.
    control = _send_one(alice, denied, b"control")
    assert control is not None and control.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, control

    held = [f"held-{i}".encode() for i in range(200)]
    flowing = [f"flowing-{i}".encode() for i in range(200)]
    # preflight "warn": a one-node cluster cannot hold the replication factor the check asks for.
    with ReliableProducer(alice, outbox_path=tmp_path / "o.db", preflight="warn") as producer:
        sent_held = producer.send_many([(denied, v) for v in held[:100]])
        producer.send_many([(allowed, v) for v in flowing])
        # Gate: Kafka has refused the held topic's messages (the outbox records why) ...
        _wait_for(lambda: "TOPIC_AUTHORIZATION_FAILED" in (producer.reason(sent_held[0]) or ""), "the refusal")
        producer.send_many([(denied, v) for v in held[100:]])
        # ... and the other topic went on meanwhile: everything sent to it is confirmed.
        _wait_for(lambda: producer.pending == len(held), "the allowed topic's messages")
        assert producer.stats().failed == 0 and producer.failed() == []
        _grant(secured, ALICE, denied, AclOperation.WRITE)
        assert producer.flush(90) == 0
        assert producer.stats().failed == 0
    assert f"not authorized to Write topic {denied!r}" in caplog.text and "kafka-acls" in caplog.text
    admin = secured.client_config()
    got_held = [m.value() for m in consume_all(secured.bootstrap_servers, denied, config=admin)]
    got_flowing = [m.value() for m in consume_all(secured.bootstrap_servers, allowed, config=admin)]
    assert got_held == held, (len(got_held), len(set(got_held)))  # none lost, none twice, in order
    assert got_flowing == flowing


def test_an_idempotent_producer_refused_its_producer_id_keeps_messages_pending_until_write_is_granted(
    secured: LocalKafkaCluster, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """No Write anywhere: the broker refuses the idempotent producer id (CLUSTER_AUTHORIZATION_FAILED,
    fatal to that client). The outbox keeps every message; granted Write (KIP-679), they all arrive."""
    topic = f"s-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    bob = "bob-" + uuid.uuid4().hex[:6]  # a SCRAM user created now, granted Write nowhere
    secured.add_user(bob, uuid.uuid4().hex)
    _grant(secured, bob, topic, AclOperation.DESCRIBE)
    conf = secured.client_config(bob)
    caplog.set_level(logging.INFO, logger="reliable_kafka.producer")
    values = [f"v-{i}".encode() for i in range(300)]
    with ReliableProducer(conf, outbox_path=tmp_path / "o.db", preflight="warn") as producer:
        producer.send_many([(topic, v) for v in values])
        # Gate: the producer id was refused and the producer rebuilt at least once.
        _wait_for(lambda: producer.stats().recreated >= 1, "the refused producer id")
        assert producer.pending == len(values) and producer.stats().failed == 0
        _grant(secured, bob, topic, AclOperation.WRITE)
        assert producer.flush(120) == 0
        assert producer.stats().failed == 0
    assert "IdempotentWrite" in caplog.text
    got = [m.value() for m in consume_all(secured.bootstrap_servers, topic, config=secured.client_config())]
    assert got == values


def test_a_producer_principal_without_describe_configs_gets_the_replication_check_not_a_refusal(
    secured: LocalKafkaCluster, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Describe and Write, as `kafka-acls --producer` grants: the topic's configuration is unreadable, so
    the preflight checks what the metadata shows (replication factor) and says what it could not check."""
    topic = f"s-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    _grant(secured, ALICE, topic, AclOperation.DESCRIBE, AclOperation.WRITE)
    with (ReliableProducer(secured.client_config(ALICE), outbox_path=tmp_path / "o.db") as producer,
          pytest.raises(TopicConfigError, match="replication factor 1")):
        producer.send(topic, b"refused: one replica")
    caplog.set_level(logging.WARNING, logger="reliable_kafka")
    with ReliableProducer(secured.client_config(ALICE), outbox_path=tmp_path / "w.db", preflight="warn") as producer:
        assert producer.wait(producer.send(topic, b"sent"), 60) == "delivered"
    assert "min.insync.replicas and unclean.leader.election.enable were not checked" in caplog.text
    assert "DescribeConfigs" in caplog.text


def test_a_consumer_refused_its_group_says_which_grant_is_missing_and_reads_everything_once_granted(
    secured: LocalKafkaCluster, caplog: pytest.LogCaptureFixture
) -> None:
    topic, group = f"s-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    values = [f"v-{i}".encode() for i in range(50)]
    p = Producer(secured.client_config())
    for v in values:
        p.produce(topic, v)
    assert p.flush(30) == 0
    _grant(secured, ALICE, topic, AclOperation.DESCRIBE, AclOperation.READ)  # the topic, not the group
    caplog.set_level(logging.INFO, logger="reliable_kafka.consumer")
    got: list[bytes] = []
    with ReliableConsumer({**secured.client_config(ALICE), "group.id": group}, [topic]) as consumer:
        # Gate: the group was refused (said once, with the grant) and nothing was read.
        deadline = time.monotonic() + 60
        while "GROUP_AUTHORIZATION_FAILED" not in caplog.text:
            assert time.monotonic() < deadline, "the group refusal was never said"
            assert consumer.poll(0.2) is None
        assert f"--group {group}" in caplog.text
        bindings = [AclBinding(ResourceType.GROUP, group, ResourcePatternType.LITERAL, f"User:{ALICE}", "*",
                               AclOperation.READ, AclPermissionType.ALLOW)]
        for future in secured.admin().create_acls(bindings).values():
            future.result(timeout=30)
        deadline = time.monotonic() + 90
        while len(got) < len(values) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None:
                got.append(msg.value())
                consumer.ack(msg)
        consumer.commit()
    assert got == values
    said = [r for r in caplog.records if r.name == "reliable_kafka.consumer.fetcher"
            and "GROUP_AUTHORIZATION_FAILED" in r.getMessage()]
    assert len(said) == 1, said  # once, not once per poll


# Everything a secured application run writes, in one process of its own (so that its OpenTelemetry SDK
# is its own): DEBUG logs of every logger including librdkafka's (debug=all), spans (console exporter),
# the outbox and dedup files, the producer's and consumer's stats, doctor's findings.
_SECRET_RUN = """
import json, logging, os, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
started = time.monotonic()
def took(what):
    print(f"{what}: {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
logging.basicConfig(filename=out / "run.log", level=logging.DEBUG, format="%(name)s %(levelname)s %(message)s")
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
spans = open(out / "spans.json", "w")
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=spans)))
trace.set_tracer_provider(provider)
from reliable_kafka import DedupPolicy, ReliableConsumer, ReliableProducer
from reliable_kafka.admin import admin_client
from reliable_kafka.dedup import SQLiteDedupStore
from reliable_kafka.doctor import diagnose
conf = json.loads(os.environ["SECRET_RUN_CONF"])
topic, group = os.environ["SECRET_RUN_TOPIC"], os.environ["SECRET_RUN_GROUP"]
loud = {**conf, "debug": "all"}
with ReliableProducer(loud, outbox_path=out / "outbox.db", preflight="warn") as p:
    p.send_many([(topic, f"v-{i}".encode()) for i in range(20)])
    assert p.flush(60) == 0
    (out / "producer-stats.json").write_text(json.dumps(dict(p.stats())))
took("produced")
seen = []
consumer = ReliableConsumer({**loud, "group.id": group}, [topic], dedup=DedupPolicy(SQLiteDedupStore(out / "dedup.db")))
def handle(msg):
    seen.append(msg.value())
    if len(seen) == 20:
        consumer.stop()
limit = threading.Timer(90, consumer.stop)
limit.start()
consumer.run(handle)
limit.cancel()  # else the interpreter waits for it at exit
took("consumed")
consumer.close()
took("consumer closed")
(out / "consumer-stats.json").write_text(json.dumps(dict(consumer.stats())))
boot = conf.pop("bootstrap.servers")
(out / "doctor.json").write_text(json.dumps([f.as_json() for f in diagnose(admin_client(boot, conf), timeout=10)]))
took("doctor")
spans.close()
print(len(seen))
"""


def test_no_secret_shows_in_anything_a_secured_run_writes(secured: LocalKafkaCluster, tmp_path) -> None:
    """A run as ALICE (password SENTINEL) logs at DEBUG with librdkafka's debug=all, traces every message,
    keeps an outbox and a dedup file, reports stats and doctor findings: the password is in none of it,
    nor in what `reliable-kafka doctor --json -vv` prints."""
    import json
    import os
    import subprocess
    import sys

    from click.testing import CliRunner

    from reliable_kafka.cli.main import cli

    topic, group = f"s-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    secured.create_topic(topic, 1, 1)
    _grant(secured, ALICE, topic, AclOperation.DESCRIBE, AclOperation.WRITE, AclOperation.READ)
    bindings = [AclBinding(ResourceType.GROUP, group, ResourcePatternType.LITERAL, f"User:{ALICE}", "*",
                           AclOperation.READ, AclPermissionType.ALLOW)]
    for future in secured.admin().create_acls(bindings).values():
        future.result(timeout=30)
    conf = secured.client_config(ALICE)
    assert conf["sasl.password"] == SENTINEL
    # The settings reach the run through its environment, as a deployment's secret store hands them over.
    env = {**os.environ, "SECRET_RUN_CONF": json.dumps(conf), "SECRET_RUN_TOPIC": topic, "SECRET_RUN_GROUP": group}
    run = subprocess.run([sys.executable, "-c", _SECRET_RUN, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=240, check=False)
    assert run.returncode == 0 and run.stdout.strip() == "20", run.stdout[-2000:] + run.stderr[-4000:]
    properties = tmp_path / "client.properties"
    properties.write_text("".join(f"{k}={v}\n" for k, v in conf.items()))
    doctor = CliRunner().invoke(cli, ["-vv", "doctor", "--json", "--config", str(properties)])
    assert doctor.exit_code in (0, 2), doctor.stdout + doctor.stderr
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p != properties}
    for name in ("run.log", "spans.json", "outbox.db", "dedup.db", "doctor.json"):
        assert written.get(name), f"the run wrote no {name}"
    # What is searched is what this test means to search: librdkafka's SASL chatter and per-message spans.
    assert b"SASL" in written["run.log"] and written["spans.json"].count(f"{topic}".encode()) >= 20
    shown = {**written, "stdout+stderr": (run.stdout + run.stderr).encode(),
             "doctor": (doctor.stdout + doctor.stderr).encode()}
    leaked = [name for name, data in shown.items() if SENTINEL.encode() in data]
    assert leaked == [], f"the password shows in {leaked}"


def test_a_processor_refused_its_transactional_id_stops_naming_the_grant(secured: LocalKafkaCluster) -> None:
    """Everything but the transactional id: Read on the input and the group, Write on the output. The
    transaction coordinator refuses the id; the processor stops with the grant, and nothing is committed."""
    from reliable_kafka import TransactionalIdAuthorizationFailed
    from reliable_kafka.transactions import OutputRecord, TransactionalProcessor

    source, output, group = (f"s-{uuid.uuid4().hex[:8]}", f"s-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}")
    for topic in (source, output):
        secured.create_topic(topic, 1, 1)
    _grant(secured, ALICE, source, AclOperation.DESCRIBE, AclOperation.READ)
    _grant(secured, ALICE, output, AclOperation.DESCRIBE, AclOperation.WRITE)
    bindings = [AclBinding(ResourceType.GROUP, group, ResourcePatternType.LITERAL, f"User:{ALICE}", "*",
                           AclOperation.READ, AclPermissionType.ALLOW)]
    for future in secured.admin().create_acls(bindings).values():
        future.result(timeout=30)
    feed = Producer(secured.client_config())
    for i in range(5):
        feed.produce(source, f"in-{i}".encode())
    assert feed.flush(30) == 0
    tid = f"copy-{uuid.uuid4().hex[:6]}"
    processor = TransactionalProcessor(
        {**secured.client_config(ALICE), "group.id": group}, input_topics=[source], transactional_id=tid,
        transform=lambda m: [OutputRecord(output, m.value(), m.key())],
    )
    with pytest.raises(TransactionalIdAuthorizationFailed) as refused, processor:
        processor.run()
    assert f"--transactional-id {tid}" in str(refused.value) and SENTINEL not in str(refused.value)
    assert list(consume_all(secured.bootstrap_servers, output, config=secured.client_config(), timeout=5)) == []


def test_producer_crash_on_a_sasl_scram_tls_cluster_loses_nothing_and_the_control_does(
    secured: LocalKafkaCluster, request: pytest.FixtureRequest,
) -> None:
    """The loss lab's scenario on this cluster: its clients and the producer programs it SIGKILLs log in
    with the cluster's settings (one node: what a SIGKILL loses is the client's buffer, whatever the
    replication; the lab itself runs 3 nodes)."""
    request.node.rk_cluster = secured  # broker logs attached to a failure report
    # Smaller than the lab's run (5 kills of 30,000): each kill still catches accepted, undelivered messages.
    results = {r.client: r for r in producer_crash(secured, no_progress, kills=2, messages=8_000,
                                                   between=(500, 1_500))}
    ours, control = results[RELIABLE], results[CONTROL]
    assert ours.acked > 0 and ours.lost == 0 and ours.duplicates_after_dedup == 0, ours
    # The control bites: its process died with acknowledged-as-accepted messages in its buffer.
    assert control.acked > 0 and control.lost > 0, control
