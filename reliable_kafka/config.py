"""Safe client configuration: the one place that knows what "safe" means.

User settings are merged on top of safe defaults; a setting that would weaken a delivery guarantee
is refused with a `ConfigError` naming the key and why, never silently rewritten.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from reliable_kafka.errors import ConfigError

# librdkafka accepts several spellings of some keys; each alias maps to its canonical name.
_ALIASES = {
    "request.required.acks": "acks",
    "max.in.flight": "max.in.flight.requests.per.connection",
    "message.send.max.retries": "retries",
    "delivery.timeout.ms": "message.timeout.ms",
    "queue.buffering.max.ms": "linger.ms",
    "bootstrap.servers": "bootstrap.servers",
    "metadata.broker.list": "bootstrap.servers",
}

UNLIMITED_RETRIES = 2_147_483_647

PRODUCER_DEFAULTS: dict[str, Any] = {
    # A message counts as delivered only once every in-sync replica has it (L1).
    "acks": "all",
    # Retries can neither duplicate nor reorder (L5); librdkafka then allows at most 5 in flight.
    "enable.idempotence": True,
    "max.in.flight.requests.per.connection": 5,
    "retries": UNLIMITED_RETRIES,
    # Long enough to ride out a leader election or a rolling restart; when it still expires the
    # message stays in the outbox and is sent again, so this bounds latency, not durability.
    "message.timeout.ms": 300_000,
    "linger.ms": 5,
    "batch.num.messages": 10_000,
    "queue.buffering.max.messages": 500_000,
    "queue.buffering.max.kbytes": 1_048_576,
    "retry.backoff.ms": 100,
    "retry.backoff.max.ms": 1_000,
    "socket.keepalive.enable": True,
}

CONSUMER_DEFAULTS: dict[str, Any] = {
    # Offsets are stored and committed by us, only for processed messages (L6).
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    # Never hand the application records of aborted or still-open transactions.
    "isolation.level": "read_committed",
    "auto.offset.reset": "earliest",
    "enable.partition.eof": False,
    "session.timeout.ms": 45_000,
    "max.poll.interval.ms": 300_000,
    # Once a partition's prefetch queue passes queued.min.messages, librdkafka's default postpones
    # its next fetch by a whole second: a handler a little slower than the brokers then drains the
    # queue and waits idle for the rest of that second. Measured here on 1M records: 118k records/s
    # at the default, 360k at 100 ms (librdkafka's CONFIGURATION.md suggests lowering it for this).
    "fetch.queue.backoff.ms": 100,
}


def _canonical(config: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        out[_ALIASES.get(key, key)] = value
    return out


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


def _as_int(key: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected a whole number, got {value!r}") from None


def _check_producer(cfg: Mapping[str, Any], *, transactional: bool) -> None:
    acks = str(cfg["acks"]).strip().lower()
    if acks not in ("all", "-1"):
        raise ConfigError(
            "acks",
            f"{cfg['acks']!r} lets the leader acknowledge before the followers have the record, so a "
            "leader failure loses acknowledged messages; reliable_kafka requires acks=all",
        )
    if not _truthy(cfg["enable.idempotence"]):
        raise ConfigError(
            "enable.idempotence",
            "false lets retries write duplicates and reorder messages; reliable_kafka requires true",
        )
    inflight = _as_int("max.in.flight.requests.per.connection", cfg["max.in.flight.requests.per.connection"])
    if not 1 <= inflight <= 5:
        raise ConfigError(
            "max.in.flight.requests.per.connection",
            f"{inflight} is outside 1..5, where the idempotent producer can keep order across retries",
        )
    retries = _as_int("retries", cfg["retries"])
    if retries < UNLIMITED_RETRIES:
        raise ConfigError(
            "retries",
            f"{retries} caps retries, turning a short outage into failed sends; leave it unlimited and "
            "bound delivery time with message.timeout.ms instead",
        )
    if "transactional.id" in cfg and not transactional:
        raise ConfigError(
            "transactional.id",
            "a transactional producer needs begin/commit around every send; use TransactionalProcessor",
        )
    if "bootstrap.servers" not in cfg or not str(cfg["bootstrap.servers"]).strip():
        raise ConfigError("bootstrap.servers", "is required: where are the brokers?")


def producer_config(user: Mapping[str, Any] | None = None, *, transactional: bool = False) -> dict[str, Any]:
    """Safe producer settings with the user's merged on top; unsafe user settings raise ConfigError."""
    cfg = dict(PRODUCER_DEFAULTS)
    cfg.update(_canonical(user or {}))
    _check_producer(cfg, transactional=transactional)
    return cfg


def keyed_record_config(user: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """producer_config() without idempotence, for a few keyed records whose duplicates change nothing.

    Only for writes of one record per key whose retry repeats the same key and value into a compacted
    topic, acknowledged before the next write (the Spark writer's plans, manifests and tombstones): a
    duplicate or a retry's reordering leaves every key's last value as it was. An idempotent producer's
    first send waits for a producer id, 0.5 s when it produces at once (reliable_kafka/producer_id.py
    says why; priming the id would still cost two metadata requests): one such record took 0.52-1.59 s,
    against 0.014-0.037 s without idempotence, acks=all either way (a 3-node local cluster).
    """
    cfg = producer_config(user)
    cfg["enable.idempotence"] = False
    cfg["max.in.flight.requests.per.connection"] = 1  # one request at a time: a retry cannot overtake
    return cfg


def consumer_config(user: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Safe consumer settings with the user's merged on top; unsafe user settings raise ConfigError."""
    cfg = dict(CONSUMER_DEFAULTS)
    cfg.update(_canonical(user or {}))
    if _truthy(cfg["enable.auto.commit"]):
        raise ConfigError(
            "enable.auto.commit",
            "true commits offsets on a timer, before the handler finished, so a crash skips messages; "
            "reliable_kafka commits processed offsets itself",
        )
    if _truthy(cfg["enable.auto.offset.store"]):
        raise ConfigError(
            "enable.auto.offset.store",
            "true stores an offset when poll() returns the message, not when it was processed",
        )
    if str(cfg["isolation.level"]).lower() != "read_committed":
        raise ConfigError(
            "isolation.level",
            "read_uncommitted hands out records of transactions that may still abort",
        )
    reset = str(cfg["auto.offset.reset"]).lower()
    if reset not in ("earliest", "smallest", "beginning", "latest", "largest", "end", "error"):
        raise ConfigError("auto.offset.reset", f"{reset!r} is not earliest, latest or error")
    if not str(cfg.get("group.id", "")).strip():
        raise ConfigError("group.id", "is required: committed offsets belong to a consumer group")
    if "bootstrap.servers" not in cfg or not str(cfg["bootstrap.servers"]).strip():
        raise ConfigError("bootstrap.servers", "is required: where are the brokers?")
    return cfg


TRANSACTIONAL_DEFAULTS: dict[str, Any] = {
    # How long the coordinator lets a transaction stay open before aborting it. It also bounds how
    # long a crashed instance's open transaction holds back read_committed readers (until the
    # same transactional.id starts again, which aborts it at once).
    "transaction.timeout.ms": 60_000,
    # While the previous transaction's markers are being written (a few ms), the coordinator answers
    # the next transaction's first request with CONCURRENT_TRANSACTIONS, and librdkafka waits
    # retry.backoff.ms before asking again: 100 ms would add about that much to every commit.
    "retry.backoff.ms": 10,
}


_MAX_TRANSACTION_LINGER_MS = 1_000


def transactional_producer_config(user: Mapping[str, Any] | None, transactional_id: str, *,
                                  commit_interval_s: float | None = None) -> dict[str, Any]:
    """Safe settings for a transactional producer: producer_config() plus `transactional.id`.

    `message.timeout.ms` defaults to `transaction.timeout.ms`: a message must not outlive its own
    transaction (librdkafka refuses the larger value). A user value above it raises ConfigError.

    `commit_interval_s`: how long the caller's transactions stay open; `linger.ms` then defaults to it.
    A read_committed reader sees no record before its transaction commits, and commit_transaction()
    sends whatever still lingers, so lingering that long delays nothing a reader can see. What it saves:
    at 5 ms an idempotent producer's batches are ready while the partition's one request is still out,
    and its broker threads spin on them (wake-ups with nothing to send); the exactly-once processor
    copying 5M records spent 0.3-0.6 us less CPU a record with its 100 ms (5.33-5.46 -> 4.89-5.12 us,
    the same rounds; CHANGELOG, "Exactly-once: a transaction's records linger until its commit").
    """
    if not str(transactional_id or "").strip():
        raise ConfigError("transactional.id", "is required: a stable name per processor instance")
    cfg = {**TRANSACTIONAL_DEFAULTS, **_canonical(user or {})}
    if "transactional.id" in cfg and cfg["transactional.id"] != transactional_id:
        raise ConfigError(
            "transactional.id",
            f"given twice ({cfg['transactional.id']!r} in the config, {transactional_id!r} as argument)",
        )
    cfg["transactional.id"] = transactional_id
    txn_timeout = _as_int("transaction.timeout.ms", cfg["transaction.timeout.ms"])
    cfg.setdefault("message.timeout.ms", txn_timeout)
    if commit_interval_s is not None and "linger.ms" not in cfg:
        # At most a second (by then a batch is full at any rate where this matters) and half of
        # message.timeout.ms (librdkafka refuses a linger.ms that is not below it).
        cap = min(_MAX_TRANSACTION_LINGER_MS, _as_int("message.timeout.ms", cfg["message.timeout.ms"]) // 2)
        cfg["linger.ms"] = max(PRODUCER_DEFAULTS["linger.ms"], min(cap, round(commit_interval_s * 1000)))
    cfg = producer_config(cfg, transactional=True)
    if _as_int("message.timeout.ms", cfg["message.timeout.ms"]) > txn_timeout:
        raise ConfigError(
            "message.timeout.ms",
            f"{cfg['message.timeout.ms']} exceeds transaction.timeout.ms ({txn_timeout}): a message "
            "would outlive the transaction that carries it",
        )
    return cfg


# Where the brokers are and how to reach and log in to them: librdkafka global properties that every
# client type (producer, consumer, admin) accepts. A helper client that reliable_kafka builds from the
# user's config (the dead-letter producer, the preflight's admin client, Spark's marker and offset
# clients) gets these and nothing else: the rest is tuning for one client type, which another type
# refuses (a consumer's group.id in a producer) or would misapply (a producer's linger.ms in a reader).
CONNECTION_KEYS = frozenset({
    "bootstrap.servers",
    "metadata.broker.list",  # the old name of bootstrap.servers
    "security.protocol",
    "connections.max.idle.ms",
    "enable.ssl.certificate.verification",
    "enable.sasl.oauthbearer.unsecure.jwt",
    "oauth_cb",  # confluent-kafka's SASL/OAUTHBEARER token callback: the login itself
})
CONNECTION_PREFIXES = (
    "sasl.",  # mechanism, username/password, kerberos, oauthbearer (OIDC) settings
    "ssl.",  # certificates, keys, CA, endpoint identification
    "https.",  # the CA used to fetch OIDC tokens
    "socket.",  # timeouts, keepalive, buffer sizes
    "client.",  # client.id, client.rack, client.dns.lookup, client.software.*
    "broker.",  # broker.address.family, broker.address.ttl, broker.version.fallback
    "api.version.",
    "reconnect.",  # reconnect.backoff.ms / .max.ms
    "metadata.",  # metadata.max.age.ms, metadata.recovery.*
    "topic.metadata.",  # refresh and propagation of topic metadata
)


def connection_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """Only the settings of `config` that say where the brokers are and how to connect and log in."""
    return {k: v for k, v in config.items() if k in CONNECTION_KEYS or k.startswith(CONNECTION_PREFIXES)}


# Settings of the Java client that librdkafka does not take, and what to use instead: what people bring
# from Spark's Kafka connector or a Java application. librdkafka knows a few of these names only to
# refuse any value; tests/unit/test_config.py checks against the installed librdkafka that it refuses
# every name here and knows every replacement.
JAVA_CLIENT_SETTINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "max.request.size": (("message.max.bytes",), "the largest request, and so message, the client sends"),
    "sasl.jaas.config": (("sasl.mechanism", "sasl.username", "sasl.password"),
                         "a PLAIN or SCRAM login is the JAAS line's username and password, with sasl.mechanism"),
    "ssl.truststore.location": (("ssl.ca.location",), "the CA certificate(s) as a PEM file"),
    "ssl.truststore.password": (("ssl.ca.location",), "a PEM CA file has no password"),
    "ssl.truststore.type": (("ssl.ca.location",), "librdkafka reads CA certificates as PEM"),
    "ssl.keystore.type": (("ssl.keystore.location", "ssl.certificate.location", "ssl.key.location"),
                          "ssl.keystore.location takes a PKCS#12 file; PEM files go to ssl.certificate.location "
                          "and ssl.key.location"),
    "buffer.memory": (("queue.buffering.max.kbytes",), "the producer's buffer, in kilobytes"),
    "fetch.max.wait.ms": (("fetch.wait.max.ms",), "how long a fetch waits for fetch.min.bytes"),
    "receive.buffer.bytes": (("socket.receive.buffer.bytes",), "the socket's receive buffer"),
    "send.buffer.bytes": (("socket.send.buffer.bytes",), "the socket's send buffer"),
    "partitioner.class": (("partitioner",), "a named partitioner; murmur2_random hashes keys as the Java client"),
    "interceptor.classes": (("plugin.library.paths",), "interceptors are C plugins in librdkafka"),
    "key.serializer": ((), "keys are sent as bytes: give a string or binary key"),
    "value.serializer": ((), "values are sent as bytes: give a string or binary value"),
    "key.deserializer": ((), "keys are read as bytes: decode them yourself"),
    "value.deserializer": ((), "values are read as bytes: decode them yourself"),
    "max.block.ms": ((), "librdkafka's produce() never blocks; message.timeout.ms bounds a delivery"),
    "default.api.timeout.ms": ((), "each call takes its own timeout"),
}


def _without_value(message: str, value: Any) -> str:
    # librdkafka quotes a refused value in its message; a password must not reach a log or a traceback.
    return message.replace(f'"{value}"', '"<value>"')


def check_client_settings(settings: Mapping[str, Any], *, key_prefix: str = "") -> None:
    """Ask the installed librdkafka, without connecting anywhere, whether it takes every name and value.

    A name it does not know raises ConfigError(key_prefix + name) with the librdkafka name to use when
    it is a Java client's setting, or the closest librdkafka names; an invalid value raises with
    librdkafka's reason (the value itself left out). Without a loadable librdkafka property table
    (see rdkafka_conf) nothing is checked here and the client refuses them when it starts.
    """
    from reliable_kafka.rdkafka_conf import property_table

    table = property_table()
    if table is None:
        return
    for refusal in table.check(settings):
        key = key_prefix + refusal.key
        version = f"librdkafka {table.version_str}"
        if refusal.key in JAVA_CLIENT_SETTINGS:
            targets, why = JAVA_CLIENT_SETTINGS[refusal.key]
            use = f"use {', '.join(key_prefix + t for t in targets)}" if targets else "leave it out"
            raise ConfigError(key, f"is a Java client setting that {version} does not take: {use} ({why})")
        if not refusal.unknown:
            raise ConfigError(key, f"{_without_value(refusal.message, settings[refusal.key])} ({version})")
        close = difflib.get_close_matches(refusal.key, table.names(), n=3, cutoff=0.7)
        hint = f"; did you mean {' or '.join(key_prefix + c for c in close)}?" if close else ""
        raise ConfigError(key, f"is not a {version} property (see librdkafka's CONFIGURATION.md){hint}")
