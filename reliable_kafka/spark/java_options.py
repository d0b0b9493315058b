"""Spark's own Kafka source and sink take the Java client's settings: the one place that turns a librdkafka
connection (what the rest of reliable_kafka takes) into them, so the controls and baselines that run
Spark's connector beside ours reach the same cluster as the same principal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reliable_kafka.config import connection_settings
from reliable_kafka.errors import ConfigError

_LOGIN_MODULE = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
# librdkafka settings with nothing to say to a Java client's connection (or what it does by default).
_NOTHING_TO_TRANSLATE = {"client.id", "socket.timeout.ms", "socket.keepalive.enable", "logger"}


def _jaas_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def java_kafka_options(connection: Mapping[str, Any]) -> dict[str, str]:
    """The `kafka.*` options of Spark's Kafka connector that reach what `connection` reaches.

    Translated: bootstrap.servers, security.protocol, a PLAIN or SCRAM login (sasl.mechanism(s),
    sasl.username, sasl.password: a JAAS line, as the Java client takes it), the CA that verifies the
    brokers (ssl.ca.location: a PEM truststore) and whether to check their names. Anything else of a
    connection (Kerberos, OAUTHBEARER, client certificates) raises ConfigError naming the key.
    """
    conn = {k: v for k, v in connection_settings(connection).items() if k not in _NOTHING_TO_TRANSLATE}
    out: dict[str, str] = {}
    for key in ("bootstrap.servers", "metadata.broker.list"):
        if key in conn:
            out["kafka.bootstrap.servers"] = str(conn.pop(key))
    if "security.protocol" in conn:
        out["kafka.security.protocol"] = str(conn.pop("security.protocol")).upper()
    mechanism = conn.pop("sasl.mechanism", None) or conn.pop("sasl.mechanisms", None)
    username, password = conn.pop("sasl.username", None), conn.pop("sasl.password", None)
    if mechanism is not None or username is not None or password is not None:
        mechanism = str(mechanism or "GSSAPI").upper()
        if mechanism not in _LOGIN_MODULE or username is None or password is None:
            raise ConfigError("sasl.mechanism", f"Spark's own Kafka connector is given a {mechanism} login only as "
                              "PLAIN or SCRAM with sasl.username and sasl.password; pass its kafka.sasl.* options "
                              "yourself for other logins")
        out["kafka.sasl.mechanism"] = mechanism
        out["kafka.sasl.jaas.config"] = (f"{_LOGIN_MODULE[mechanism]} required username={_jaas_quoted(str(username))} "
                                         f"password={_jaas_quoted(str(password))};")
    if "ssl.ca.location" in conn:
        out["kafka.ssl.truststore.type"] = "PEM"
        out["kafka.ssl.truststore.location"] = str(conn.pop("ssl.ca.location"))
    if "ssl.endpoint.identification.algorithm" in conn:
        checked = str(conn.pop("ssl.endpoint.identification.algorithm")).lower() != "none"
        out["kafka.ssl.endpoint.identification.algorithm"] = "https" if checked else ""
    if conn:
        key = sorted(conn)[0]
        raise ConfigError(key, "has no translation for Spark's own Kafka connector (a Java client); pass its "
                               "kafka.* option yourself")
    return out
