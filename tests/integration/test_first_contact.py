"""A new user's first contact, on the real cluster: the README's program on a topic that does not exist
yet, a send to a missing topic, a consumer subscribed to one, and `ensure_topic`."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from reliable_kafka import ReliableConsumer, ReliableProducer, TopicConfigError, TopicMissing, ensure_topic
from reliable_kafka.admin import admin_client, describe_topic
from reliable_kafka.testing import LocalKafkaCluster
from reliable_kafka.testing.gates import wait_for

pytestmark = pytest.mark.cluster

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_program() -> str:
    """The first Python block of the README's "Against your cluster" section, as a user would copy it."""
    text = README.read_text()
    section = text[text.index("## Against your cluster"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's top section has no Python block"
    return match.group(1)


def test_the_readme_program_works_on_a_fresh_topic_and_its_second_run_handles_only_the_new_message(
        kafka: LocalKafkaCluster, tmp_path: Path) -> None:
    topic, group = f"orders-{uuid.uuid4().hex[:6]}", f"billing-{uuid.uuid4().hex[:6]}"
    program = readme_program()
    # The README's names, made unique on the shared cluster: the program is otherwise run as written.
    assert program.count('"orders"') == 3 and program.count('"billing"') == 1
    program = program.replace('"orders"', repr(topic)).replace('"billing"', repr(group))
    (tmp_path / "readme.py").write_text(program)
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap_servers}
    for run in (1, 2):
        done = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=180)
        assert done.returncode == 0, f"run {run}: {done.stderr[-3000:]}"
        # What the README says it prints, each run: the second handles only the message it sent.
        assert done.stdout.splitlines() == ['charged {"id": 42, "total": 99.5}', "handled 1"], done.stdout
    created = describe_topic(admin_client(kafka.bootstrap_servers), topic)
    assert created is not None and created.problems() == []
    assert (created.partitions, created.replication_factor, created.min_insync_replicas) == (3, 3, 2)


def test_a_send_to_a_missing_topic_is_refused_at_once_naming_the_fix(kafka: LocalKafkaCluster,
                                                                       tmp_path: Path) -> None:
    topic = f"missing-{uuid.uuid4().hex[:6]}"
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, outbox_path=tmp_path / "o.db") as p:
        started = time.monotonic()
        with pytest.raises(TopicMissing) as refused:
            p.send(topic, b"x")
        assert time.monotonic() - started < 20
        assert isinstance(refused.value, TopicConfigError) and refused.value.topic == topic
        assert "ensure_topic" in str(refused.value) and f"--topic {topic}" in str(refused.value)
        assert p.pending == 0 and p.failed() == [], "a refused send accepted nothing"
        # Once the topic exists, the same producer sends to it.
        ensure_topic({"bootstrap.servers": kafka.bootstrap_servers}, topic, partitions=1)
        p.send(topic, b"now")
        assert p.flush(60) == 0


def test_ensure_topic_leaves_an_existing_topic_as_it_is_and_says_why_it_is_weak(
        kafka: LocalKafkaCluster, make_topic, caplog: pytest.LogCaptureFixture) -> None:
    weak = make_topic(configs={"min.insync.replicas": 1})
    with caplog.at_level(logging.WARNING, logger="reliable_kafka.admin"):
        got = ensure_topic({"bootstrap.servers": kafka.bootstrap_servers}, weak)
    assert got.min_insync_replicas == 1, "an existing topic is never altered"
    assert any("min.insync.replicas=1" in r.getMessage() and weak in r.getMessage() for r in caplog.records)


def test_a_consumer_of_a_missing_topic_says_so_with_the_fix_and_reads_it_once_created(
        kafka: LocalKafkaCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    topic = f"missing-{uuid.uuid4().hex[:6]}"
    config = {"bootstrap.servers": kafka.bootstrap_servers}
    conf = {**config, "group.id": f"g-{uuid.uuid4().hex[:6]}",
            "topic.metadata.refresh.interval.ms": 1000}  # how soon a topic created later is seen
    handled: list[bytes] = []

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno == logging.WARNING and topic in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="reliable_kafka"), ReliableConsumer(conf, [topic]) as consumer:
        runner = threading.Thread(target=consumer.run, args=(lambda m: handled.append(m.value()),),
                                  kwargs={"stop_after": 180})
        runner.start()
        try:
            assert wait_for(lambda: len(said()) > 0, timeout_s=60), "no warning about the missing topic"
            assert consumer.stats().handled == 0
            # Once the topic exists, the same consumer reads it: the warning said so.
            ensure_topic(config, topic, partitions=1)
            with ReliableProducer(config, outbox_path=tmp_path / "o.db") as p:
                p.send(topic, b"first")
                assert p.flush(60) == 0
            assert wait_for(lambda: handled == [b"first"], timeout_s=90), handled
        finally:
            consumer.stop()
            runner.join(60)
    (warning,) = said()  # said once
    assert "ensure_topic" in warning.getMessage() and f"--topic {topic}" in warning.getMessage()
