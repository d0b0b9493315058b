"""connection_settings(): a helper client built from the user's config gets where the brokers are and how
to log in, and none of the tuning meant for another client type."""

from __future__ import annotations

import pytest

from reliable_kafka.config import connection_settings


@pytest.mark.parametrize(
    ("key", "kept"),
    [
        # where the brokers are
        ("bootstrap.servers", True),
        ("metadata.broker.list", True),
        ("client.dns.lookup", True),
        ("broker.address.family", True),
        ("broker.address.ttl", True),
        # how to log in
        ("security.protocol", True),
        ("sasl.mechanism", True),
        ("sasl.mechanisms", True),
        ("sasl.username", True),
        ("sasl.password", True),
        ("sasl.kerberos.service.name", True),
        ("sasl.oauthbearer.method", True),
        ("sasl.oauthbearer.token.endpoint.url", True),
        ("oauth_cb", True),
        ("enable.sasl.oauthbearer.unsecure.jwt", True),
        ("https.ca.location", True),
        ("ssl.ca.location", True),
        ("ssl.certificate.location", True),
        ("ssl.key.location", True),
        ("ssl.key.password", True),
        ("ssl.endpoint.identification.algorithm", True),
        ("enable.ssl.certificate.verification", True),
        # how to keep the connection
        ("socket.timeout.ms", True),
        ("socket.keepalive.enable", True),
        ("socket.connection.setup.timeout.ms", True),
        ("connections.max.idle.ms", True),
        ("reconnect.backoff.ms", True),
        ("reconnect.backoff.max.ms", True),
        ("api.version.request", True),
        ("metadata.max.age.ms", True),
        ("topic.metadata.refresh.interval.ms", True),
        # who this client is
        ("client.id", True),
        ("client.rack", True),
        # tuning of one client type: never handed to another
        ("group.id", False),
        ("group.instance.id", False),
        ("enable.auto.commit", False),
        ("auto.offset.reset", False),
        ("isolation.level", False),
        ("fetch.max.bytes", False),
        ("max.poll.interval.ms", False),
        ("session.timeout.ms", False),
        ("acks", False),
        ("enable.idempotence", False),
        ("linger.ms", False),
        ("batch.num.messages", False),
        ("compression.type", False),
        ("message.timeout.ms", False),
        ("transactional.id", False),
        ("transaction.timeout.ms", False),
        ("queue.buffering.max.messages", False),
        ("retry.backoff.ms", False),
        ("partitioner", False),
        ("statistics.interval.ms", False),
        ("debug", False),
    ],
)
def test_connection_settings(key: str, kept: bool) -> None:
    config = {key: "x", "bootstrap.servers": "b:9092"}
    assert (key in connection_settings(config)) is kept


def test_values_pass_unchanged_and_the_input_is_not_modified() -> None:
    token = object()
    config = {"bootstrap.servers": "b:9092", "oauth_cb": token, "linger.ms": 5}
    assert connection_settings(config) == {"bootstrap.servers": "b:9092", "oauth_cb": token}
    assert config == {"bootstrap.servers": "b:9092", "oauth_cb": token, "linger.ms": 5}
