"""connection_settings(): a helper client built from the user's config gets where the brokers are and how
to log in, and none of the tuning meant for another client type. check_client_settings(): names and values
checked against the installed librdkafka's own property table, Java client names answered with theirs."""

from __future__ import annotations

import confluent_kafka
import pytest

from reliable_kafka.config import (
    CONSUMER_DEFAULTS,
    JAVA_CLIENT_SETTINGS,
    PRODUCER_DEFAULTS,
    TRANSACTIONAL_DEFAULTS,
    check_client_settings,
    connection_settings,
    keyed_record_config,
)
from reliable_kafka.errors import ConfigError
from reliable_kafka.rdkafka_conf import PropertyTable, property_table


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


def _table() -> PropertyTable:
    table = property_table()
    assert table is not None, "the librdkafka of the confluent-kafka wheel could not be loaded"
    return table


def test_the_property_table_is_that_of_the_librdkafka_confluent_kafka_runs() -> None:
    table = _table()
    assert (table.version_str, table.version) == confluent_kafka.libversion()
    names = table.names()
    # Global and topic properties, aliases included (linger.ms is an alias of queue.buffering.max.ms).
    for name in ("bootstrap.servers", "linger.ms", "queue.buffering.max.ms", "auto.offset.reset", "acks"):
        assert name in names
    assert "max.request.size" not in names


@pytest.mark.parametrize("java_name", sorted(JAVA_CLIENT_SETTINGS))
def test_every_java_client_name_is_refused_by_librdkafka_and_its_replacements_exist(java_name: str) -> None:
    table = _table()
    for value in ("1", "x"):
        assert table.check({java_name: value}), f"librdkafka takes {java_name}={value}: drop it from the hints"
    names = table.names()
    for target in JAVA_CLIENT_SETTINGS[java_name][0]:
        assert target in names, f"{target} (suggested for {java_name}) is not a librdkafka property"


def test_our_own_defaults_are_librdkafka_settings() -> None:
    check_client_settings({**PRODUCER_DEFAULTS, **TRANSACTIONAL_DEFAULTS, "bootstrap.servers": "h:9092"})
    check_client_settings({**CONSUMER_DEFAULTS, "group.id": "g", "bootstrap.servers": "h:9092"})
    # What a user brings: aliases, topic-level properties, strings for numbers and booleans.
    check_client_settings({"linger.ms": "20", "batch.size": "1000000", "compression.type": "zstd",
                           "request.timeout.ms": "30000", "enable.idempotence": "true", "security.protocol": "SSL",
                           "ssl.ca.location": "/nowhere/ca.pem", "partitioner": "murmur2_random"})


@pytest.mark.parametrize(
    ("settings", "key", "says"),
    [
        ({"max.request.size": "1048576"}, "kafka.max.request.size", "use kafka.message.max.bytes"),
        ({"sasl.jaas.config": "x required;"}, "kafka.sasl.jaas.config", "kafka.sasl.username, kafka.sasl.password"),
        ({"ssl.truststore.location": "/t.jks"}, "kafka.ssl.truststore.location", "use kafka.ssl.ca.location"),
        ({"buffer.memory": "33554432"}, "kafka.buffer.memory", "use kafka.queue.buffering.max.kbytes"),
        ({"key.serializer": "org.apache.kafka.common.serialization.StringSerializer"}, "kafka.key.serializer",
         "leave it out"),
        ({"linger.mss": "5"}, "kafka.linger.mss", "did you mean kafka.linger.ms?"),
        ({"no.such.thing": "5"}, "kafka.no.such.thing", "is not a librdkafka"),
        ({"linger.ms": "soon"}, "kafka.linger.ms", "Invalid value"),
    ],
)
def test_settings_librdkafka_refuses_name_the_key_and_the_fix(settings: dict[str, str], key: str, says: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_client_settings({"bootstrap.servers": "h:9092", **settings}, key_prefix="kafka.")
    assert refused.value.key == key
    assert says in str(refused.value)


def test_a_refused_value_is_not_repeated_in_the_error() -> None:
    with pytest.raises(ConfigError) as refused:
        check_client_settings({"security.protocol": "hunter2-secret"})
    assert refused.value.key == "security.protocol"
    assert "hunter2" not in str(refused.value)


def test_keyed_records_are_written_with_acks_all_and_unlimited_retries_one_request_at_a_time() -> None:
    cfg = keyed_record_config({"bootstrap.servers": "127.0.0.1:1", "linger.ms": 0})
    assert str(cfg["acks"]) in ("all", "-1") and cfg["retries"] >= 2**31 - 1, cfg
    assert cfg["enable.idempotence"] is False and cfg["max.in.flight.requests.per.connection"] == 1, cfg
    # Everything producer_config() refuses is refused here too: only idempotence is left out.
    with pytest.raises(ConfigError, match="acks"):
        keyed_record_config({"bootstrap.servers": "127.0.0.1:1", "acks": 1})
    with pytest.raises(ConfigError, match="retries"):
        keyed_record_config({"bootstrap.servers": "127.0.0.1:1", "retries": 3})
