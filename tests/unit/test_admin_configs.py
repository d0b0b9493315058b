"""Reading a topic's configuration right after the topic was created.

CI caught it: the marker topic was created and its leaders seen, then DescribeConfigs went to a
broker whose metadata did not have the topic yet and failed with UNKNOWN_TOPIC_OR_PART. Both
readers of topic configs (`admin.topic_configs`, `MarkerTopic.ensure`) must retry that moment and
still fail, with a clear error, when the topic really is not there.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import ConfigResource

from reliable_kafka.admin import topic_configs
from reliable_kafka.errors import ClusterUnreachable, TopicConfigError
from reliable_kafka.spark import markers


class Entry:
    def __init__(self, value: str) -> None:
        self.value = value


class FakeTopic:
    def __init__(self) -> None:
        self.error = None
        self.partitions = {0: type("P", (), {"leader": 1})()}


class FakeMetadata:
    def __init__(self, topic: str) -> None:
        self.topics = {topic: FakeTopic()}
        self.brokers = {1: object(), 2: object(), 3: object()}


class LaggingAdmin:
    """DescribeConfigs fails `unknown_for` times with UNKNOWN_TOPIC_OR_PART, then answers."""

    def __init__(self, topic: str, unknown_for: int, policy: str = "compact") -> None:
        self.topic = topic
        self.unknown_for = unknown_for
        self.policy = policy
        self.calls = 0

    def list_topics(self, *args: Any, **kwargs: Any) -> FakeMetadata:
        return FakeMetadata(self.topic)

    def describe_configs(self, resources: list[ConfigResource], **kwargs: Any) -> dict[ConfigResource, Future]:
        self.calls += 1
        future: Future = Future()
        if self.calls <= self.unknown_for:
            future.set_exception(KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)))
        else:
            future.set_result({"cleanup.policy": Entry(self.policy), "min.insync.replicas": Entry("2")})
        return {resources[0]: future}


def test_topic_configs_retries_a_topic_its_broker_does_not_know_yet() -> None:
    admin = LaggingAdmin("t", unknown_for=3)
    configs = topic_configs(admin, "t", timeout=10.0)  # type: ignore[arg-type]
    assert configs["min.insync.replicas"] == "2" and admin.calls == 4


def test_topic_configs_of_a_topic_that_stays_unknown_fails_clearly() -> None:
    admin = LaggingAdmin("t", unknown_for=10**6)
    with pytest.raises(ClusterUnreachable, match="configuration of topic 't'.*Unknown topic"):
        topic_configs(admin, "t", timeout=0.5)  # type: ignore[arg-type]
    assert admin.calls > 1  # retried, not failed on the first answer


def _marker_topic(monkeypatch: pytest.MonkeyPatch, admin: LaggingAdmin) -> markers.MarkerTopic:
    topic = markers.MarkerTopic({"bootstrap.servers": "127.0.0.1:1"}, admin.topic, timeout_s=5.0)
    monkeypatch.setattr(topic, "_admin", lambda: admin)
    return topic


def test_marker_topic_check_retries_a_topic_its_broker_does_not_know_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    admin = LaggingAdmin("markers", unknown_for=2)
    _marker_topic(monkeypatch, admin).ensure(3)
    assert admin.calls == 3


def test_marker_topic_check_still_refuses_a_deleting_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    admin = LaggingAdmin("markers", unknown_for=1, policy="delete")
    with pytest.raises(TopicConfigError, match="cleanup.policy=delete"):
        _marker_topic(monkeypatch, admin).ensure(3)
