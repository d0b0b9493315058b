"""ReliableProducer: acks=all + idempotence behind a disk-spooled outbox.

send() returns once the message is durable in the outbox (per the durability mode); a message
leaves the outbox only when librdkafka reports it persisted by all in-sync replicas, or moves to
`failed` with the broker's reason. Nothing is dropped: not on a full buffer, not on a crash, not
after an idempotent-producer fatal error (the producer is rebuilt and the outbox re-sent in order).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from confluent_kafka import KafkaError, KafkaException, Producer

from reliable_kafka import telemetry
from reliable_kafka.admin import admin_client, describe_topic, preflight
from reliable_kafka.config import connection_settings, producer_config
from reliable_kafka.errors import (
    ClusterUnreachable,
    ConfigError,
    DeliveryFailed,
    ProducerClosed,
    SerializationError,
    TopicConfigError,
)
from reliable_kafka.ids import ID_HEADER, new_ids
from reliable_kafka.kafka_errors import Disposition, classify, describe
from reliable_kafka.outbox import Durability, NewMessage, Outbox, OutboxRow
from reliable_kafka.spool import MemorySpool, Spool

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("reliable_kafka.rdkafka")

Headers = Mapping[str, str | bytes] | Sequence[tuple[str, str | bytes]] | None
Serializer = Callable[[Any], bytes]

# How many outbox rows the dispatcher reads per page when it re-sends a backlog.
_DISPATCH_PAGE = 2_000
# How often a preflight that could not reach the cluster is tried again.
_PREFLIGHT_RETRY_S = 30.0
# send() waits for room in librdkafka only while deliveries keep coming; after this long without
# one (brokers away) it stops waiting and the outbox takes the messages on its own.
_STALL_S = 2.0


class Sent(NamedTuple):
    """What send() returns: the message is durable (per the durability mode) and has this id.

    A NamedTuple for the same reason as NewMessage: send_many() returns one per message.
    """

    message_id: str
    seq: int
    error: str | None = None  # set when Kafka refused it at once; it is then kept in the outbox as failed


@dataclass(frozen=True)
class Message:
    """One message for send_many()."""

    topic: str
    value: Any
    key: Any = None
    headers: Headers = None
    partition: int | None = None
    message_id: str | None = None


def _to_bytes(what: str, value: Any, serializer: Serializer | None) -> bytes | None:
    if value is None:
        return None
    if serializer is not None:
        out = serializer(value)
        if not isinstance(out, (bytes, bytearray)):
            raise SerializationError(f"the {what} serializer returned {type(out).__name__}, not bytes")
        return bytes(out)
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise SerializationError(
        f"the {what} is a {type(value).__name__}, not bytes; encode it first or pass {what}_serializer="
    )


def _record_size(value: bytes | None, key: bytes | None, headers: Sequence[tuple[str, bytes]]) -> int:
    """A record's size in a batch of one: payload plus the v2 batch and record overhead (about 80 bytes)."""
    # + the rk-id header (5 + 36 bytes) that every record carries
    return 125 + len(value or b"") + len(key or b"") + sum(len(k) + len(v) + 4 for k, v in headers)


_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__ (hot paths only)


def _plain_rows(batch: Sequence[Any], ids: Sequence[str]) -> list[NewMessage] | None:
    """NewMessages for a batch made only of (topic, bytes) pairs — the hot path — else None."""
    try:
        rows = [_new_tuple(NewMessage, (i, t, v, None, (), None))
                for (t, v), i in zip(batch, ids, strict=True) if type(t) is str and t and type(v) is bytes]
    except (TypeError, ValueError):  # a Message, or a tuple of another length
        return None
    return rows if len(rows) == len(batch) else None


def _headers(headers: Headers) -> list[tuple[str, bytes]]:
    if not headers:
        return []
    items = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    for k, v in items:
        if not isinstance(k, str):
            raise SerializationError(f"header names must be str, got {type(k).__name__}")
        out.append((k, v.encode() if isinstance(v, str) else b"" if v is None else bytes(v)))
    return out


class ReliableProducer:
    """A Kafka producer that does not lose accepted messages.

    Args:
        config: librdkafka settings (at least bootstrap.servers); unsafe ones raise ConfigError.
        outbox_path: the SQLite outbox file (required unless durability="memory").
        durability: "process" (survives a crash of this process), "fsync" (survives power loss),
            or "memory" (no spool: still acks=all + idempotent, but a crash loses unconfirmed messages).
        max_pending: spool bound; a full spool makes send() block up to `send_timeout`, then raise OutboxFull.
        max_in_flight: how many messages librdkafka may hold at once (its copies cost ~700 bytes of RSS
            each). Beyond it send() waits while brokers keep confirming, like a full librdkafka queue;
            while they confirm nothing (they are away), the rest waits in the outbox instead.
        preflight: "error" (default) refuses topics whose replication cannot keep acks=all durable,
            "warn" logs it, "off" skips the check.
        on_failed: called with the OutboxRow of each message Kafka refused for good.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        outbox_path: str | os.PathLike[str] | None = None,
        durability: Durability | str = Durability.PROCESS,
        max_pending: int = 1_000_000,
        max_in_flight: int = 20_000,
        send_timeout: float = 30.0,
        preflight: str = "error",
        value_serializer: Serializer | None = None,
        key_serializer: Serializer | None = None,
        on_failed: Callable[[OutboxRow], None] | None = None,
    ) -> None:
        self._config = producer_config(config)
        for owned in ("on_delivery", "dr_msg_cb", "dr_cb"):
            if owned in self._config:
                raise ConfigError(owned, "ReliableProducer owns delivery reports (they clear the outbox); use "
                                         "on_failed=, wait() or state() to follow a message")
        if str(self._config.get("delivery.report.only.error", "false")).strip().lower() in ("true", "1"):
            # (The Spark writer sets it on its own producers: it learns of success from flush() instead.)
            raise ConfigError("delivery.report.only.error",
                              "true hides successful deliveries, so a message could never leave the outbox")
        self.durability = Durability(durability)
        if preflight not in ("error", "warn", "off"):
            raise ConfigError("preflight", f"{preflight!r} is not 'error', 'warn' or 'off'")
        self._preflight_mode = preflight
        if max_in_flight < 1:
            raise ConfigError("max_in_flight", f"must be at least 1, got {max_in_flight}")
        self._max_in_flight = max_in_flight
        self._last_progress = time.monotonic()  # when a delivery was last confirmed (or the start)
        self._send_timeout = send_timeout
        self._value_serializer = value_serializer
        self._key_serializer = key_serializer
        self._on_failed = on_failed
        self._spool: Spool
        if self.durability is Durability.MEMORY:
            if outbox_path is not None:
                raise ConfigError("outbox_path", "durability='memory' keeps no outbox file; drop the path")
            self._spool = MemorySpool(max_pending)
        else:
            if outbox_path is None:
                raise ConfigError(
                    "outbox_path", f"durability={self.durability.value!r} needs an outbox file to spool to"
                )
            self._spool = Outbox(Path(outbox_path), durability=self.durability, max_messages=max_pending)

        # Order of sends is the order of seqs; this lock keeps append + hand-over to librdkafka in that order.
        self._send_lock = threading.RLock()
        self._dispatched_upto = 0  # every pending seq <= this was handed to librdkafka (this generation)
        self._last_seq = 0
        self._redeliver: deque[int] = deque()  # seqs whose delivery failed retriably: hand over again
        self._generation = 0
        self._fatal: KafkaError | None = None
        self._delivered: list[int] = []  # filled by delivery callbacks on the poller thread
        self._settled = threading.Condition()
        self._checked_topics: set[str] = set()
        self._max_bytes: dict[str, int] = {}  # topic -> max.message.bytes, learnt by preflight
        self._deferred_topics: dict[str, float] = {}  # topic -> when its preflight last could not run
        self._closed = False
        self._stop = threading.Event()
        self._producer = self._new_producer()
        self._counts = {"sent": 0, "delivered": 0, "failed": 0, "retried": 0, "recreated": 0}
        # One bound method for every callback: a partial over it holds only (seq, generation, topic),
        # a tuple of atoms the garbage collector stops tracking, so each in-flight message costs it
        # one object (the partial) instead of two.
        self._report = self._on_delivery

        # Whatever a previous run left pending goes out first, in its original order.
        backlog = self._spool.pending(limit=1)
        if backlog:
            stats = self._spool.stats()
            log.info("re-sending %d pending message(s) from %s", stats.pending, outbox_path)
            self._last_seq = self._max_pending_seq()
        self._tracing = telemetry.tracing_enabled()
        telemetry.register_producer(self)
        self._poller = threading.Thread(target=self._poll_loop, name="reliable-kafka-producer", daemon=True)
        self._poller.start()

    # ---- public API ----------------------------------------------------------------------

    def send(
        self,
        topic: str,
        value: Any,
        key: Any = None,
        headers: Headers = None,
        partition: int | None = None,
        *,
        message_id: str | None = None,
    ) -> Sent:
        """Accept one message; returns once it is durable per the durability mode.

        Raises OutboxFull when the spool stayed full for send_timeout, TopicConfigError when the
        preflight refuses the topic, SerializationError for a value that is not bytes, and
        DeliveryFailed when Kafka refused it at once (it is then kept in the outbox as failed).
        """
        sent = self.send_many([Message(topic, value, key, headers, partition, message_id)])[0]
        if sent.error is not None:
            raise DeliveryFailed(sent.message_id, sent.error, topic=topic, partition=partition)
        return sent

    def send_many(self, messages: Iterable[Message | tuple[str, Any]]) -> list[Sent]:
        """Accept a batch in one outbox transaction (much faster than send() in a loop).

        Returns a Sent per message, in order; a message Kafka refused at once has `error` set.
        """
        if self._closed:
            raise ProducerClosed("send after close(): create a new ReliableProducer")
        batch = messages if isinstance(messages, list) else list(messages)
        if not batch:
            return []
        ids = new_ids(len(batch))
        rows = None if self._tracing else _plain_rows(batch, ids)
        if rows is None:
            rows = [self._prepare(m, i) for m, i in zip(batch, ids, strict=True)]
        for topic in {r.topic for r in rows} - self._checked_topics - self._deferred_topics.keys():
            self._preflight(topic)
        if len(self._producer) >= self._max_in_flight:
            self._wait_for_room()
        with self._send_lock:
            seqs = self._spool.append(rows, timeout=self._send_timeout)
            self._last_seq = seqs[-1]
            errors = self._dispatch_new(rows, seqs)
        self._counts["sent"] += len(rows)
        telemetry.messages_sent.add(len(rows))
        if errors:
            return [Sent(r.message_id, s, errors.get(s)) for r, s in zip(rows, seqs, strict=True)]
        return [_new_tuple(Sent, (r[0], s, None)) for r, s in zip(rows, seqs, strict=True)]

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every accepted message is delivered or failed; returns how many are still pending."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._settled:
            while True:
                pending = self._spool.stats().pending
                if pending == 0 or self._stop.is_set():
                    return pending
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return pending
                self._settled.wait(0.1 if left is None else min(0.1, left))

    def close(self, timeout: float | None = 30.0) -> int:
        """Stop accepting, deliver what is pending within `timeout`, release the outbox.

        Returns the number still pending. In a spooled mode they stay in the outbox and are sent
        on the next start; in memory mode they are lost, which is logged as an error.
        """
        if self._closed:
            return 0
        self._closed = True
        telemetry.unregister_producer(self)
        remaining = self.flush(timeout)
        self._stop.set()
        self._poller.join(timeout=10)
        self._apply_reports()
        remaining = self._spool.stats().pending
        if remaining:
            # Let go of what librdkafka still holds; the spool keeps it. A newer generation makes the
            # purge reports no-ops.
            self._generation += 1
            self._producer.purge(in_queue=True, in_flight=True)
            self._producer.poll(0)
            if self.durability is Durability.MEMORY:
                log.error("closing with %d undelivered message(s) in memory mode: they are lost", remaining)
            else:
                log.warning("closing with %d undelivered message(s); they stay in the outbox for the next start",
                            remaining)
        self._spool.close()
        return remaining

    def check_topics(self, topics: Iterable[str]) -> None:
        """Run the preflight for `topics` now (it otherwise runs on the first send to each topic).

        Raises TopicConfigError (preflight="error") for a topic whose replication cannot keep acks=all
        durable, and ClusterUnreachable when no broker answers.
        """
        admin = self._admin()
        for topic in topics:
            deadline = time.monotonic() + 10
            # A topic created a moment ago may not be in every broker's metadata yet.
            while (durability := preflight(admin, topic, mode=self._preflight_mode, timeout=10)) is None:
                if time.monotonic() > deadline:
                    raise TopicConfigError(topic, ["it does not exist (or has no leader yet)"])
                time.sleep(0.2)
            self._checked_topics.add(topic)
            self._deferred_topics.pop(topic, None)
            self._max_bytes[topic] = durability.max_message_bytes

    def state(self, sent: Sent) -> str:
        """"pending", "delivered" or "failed" for a message this producer accepted."""
        row = self._spool.get(sent.seq)
        return "delivered" if row is None else row.state

    def wait(self, sent: Sent, timeout: float | None = None) -> str:
        """Wait until one message is delivered or failed (or `timeout`); returns its state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._settled:
            while True:
                state = self.state(sent)
                if state != "pending" or self._stop.is_set():
                    return state
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return state
                self._settled.wait(0.05 if left is None else min(0.05, left))

    def reason(self, sent: Sent) -> str | None:
        """Why a message is failed (or the last retriable error of a pending one)."""
        row = self._spool.get(sent.seq)
        return None if row is None else row.last_error

    def forget_failed(self, sent: Sent) -> bool:
        """Delete one failed message, when the caller keeps its own copy (e.g. an uncommitted source record)."""
        return self._spool.purge(state="failed", seqs=[sent.seq]) == 1

    def failed(self, limit: int | None = None) -> list[OutboxRow]:
        """Messages Kafka refused for good, with the broker's reason (also: `reliable-kafka outbox list-failed`)."""
        return self._spool.failed(limit)

    @property
    def pending(self) -> int:
        """Accepted messages not yet confirmed delivered."""
        return self._spool.stats().pending

    @property
    def in_flight(self) -> int:
        """Messages librdkafka holds now (queued, on the wire, or with a report not yet served)."""
        return len(self._producer)

    @property
    def oldest_pending_age_s(self) -> float | None:
        """Seconds since the oldest unconfirmed message was accepted (None when nothing is pending)."""
        return self._spool.stats().oldest_pending_age_s

    @property
    def counts(self) -> dict[str, int]:
        return dict(self._counts)

    def __enter__(self) -> ReliableProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- accepting -----------------------------------------------------------------------

    def _prepare(self, m: Message | tuple[str, Any], fresh_id: str) -> NewMessage:
        """Validate and serialize one message. The rk-id is kept as message_id, not as a stored header:
        it is added when the message is handed to librdkafka."""
        if not isinstance(m, Message):
            m = Message(*m)
        if not isinstance(m.topic, str) or not m.topic:
            raise ConfigError("topic", f"must be a non-empty str, got {m.topic!r}")
        value = m.value if type(m.value) is bytes else _to_bytes("value", m.value, self._value_serializer)
        key = m.key if m.key is None or type(m.key) is bytes else _to_bytes("key", m.key, self._key_serializer)
        headers = _headers(m.headers)
        message_id = m.message_id
        if message_id is None:
            # A caller-supplied rk-id header is the caller's idempotency key: keep it.
            message_id = next((v.decode() for k, v in reversed(headers) if k == ID_HEADER), fresh_id)
        user_headers = [h for h in headers if h[0] != ID_HEADER]
        if self._tracing:
            telemetry.publish_span(m.topic, message_id, user_headers)
        return NewMessage(message_id, m.topic, value, key, tuple(user_headers), m.partition)

    def _preflight(self, topic: str, *, deferred: bool = False) -> None:
        try:
            described = preflight(self._admin(), topic, mode=self._preflight_mode, timeout=5)
        except ClusterUnreachable as exc:
            # The outbox exists to accept messages while brokers are away: the poller checks later.
            if not deferred:
                log.warning("preflight of topic %r deferred until a broker answers: %s", topic, exc)
            self._deferred_topics[topic] = time.monotonic()
            return
        except TopicConfigError as exc:
            if not deferred:
                raise
            # Messages were accepted while the check could not run; they stay and are sent, loudly.
            log.error("%s; messages accepted while brokers were unreachable are sent anyway", exc)
        self._deferred_topics.pop(topic, None)
        self._checked_topics.add(topic)
        if described is not None:
            self._max_bytes[topic] = described.max_message_bytes

    def _too_large(self, topic: str, value: bytes | None, key: bytes | None,
                   headers: Sequence[tuple[str, bytes]]) -> str | None:
        """Why a record cannot fit the topic's max.message.bytes, or None if it fits or the limit is unknown.

        Refusing it before librdkafka batches it matters: the broker rejects a whole batch for one
        oversized record, and its innocent neighbours would come back with the same error.
        """
        limit = self._max_bytes.get(topic)
        if limit is None:
            return None
        size = _record_size(value, key, headers)
        if size <= limit:
            return None
        return (f"MSG_SIZE_TOO_LARGE: a record of about {size} bytes exceeds max.message.bytes={limit} "
                f"of topic {topic!r}")

    def _refused_for_size(self, topic: str, seq: int) -> bool:
        """After the broker said MSG_SIZE_TOO_LARGE: is this record itself too large, or a batch neighbour?"""
        # The broker's word beats a cached limit: the topic may have been altered since preflight.
        try:
            described = describe_topic(self._admin(), topic, timeout=5)
        except ClusterUnreachable:
            described = None
        if described is None:
            return True
        self._max_bytes[topic] = described.max_message_bytes
        r = self._spool.get(seq)
        if r is None:
            return True
        return self._too_large(topic, r.value, r.key, r.headers) is not None

    def _retry_deferred_preflights(self) -> None:
        now = time.monotonic()
        for topic, since in list(self._deferred_topics.items()):
            if now - since >= _PREFLIGHT_RETRY_S:
                self._preflight(topic, deferred=True)

    def _admin(self) -> Any:
        keep = connection_settings(self._config)
        return admin_client(keep["bootstrap.servers"], keep)

    def _wait_for_room(self) -> None:
        """Backpressure: while the brokers confirm deliveries, wait until librdkafka holds fewer than
        max_in_flight messages. Without it a fast application runs hundreds of thousands of messages
        ahead of the brokers, and every one of them costs memory in librdkafka. While nothing is
        confirmed (brokers away) it does not wait: the outbox keeps accepting up to its bound."""
        with self._settled:
            while (len(self._producer) >= self._max_in_flight and not self._stop.is_set()
                   and self._fatal is None and time.monotonic() - self._last_progress < _STALL_S):
                self._settled.wait(0.05)

    # ---- handing messages to librdkafka (called with _send_lock held) ----------------------

    def _dispatch_new(self, rows: Sequence[NewMessage], seqs: Sequence[int]) -> dict[int, str]:
        """Hand new rows to librdkafka unless older ones are still waiting (order first)."""
        errors: dict[int, str] = {}
        if (self._dispatched_upto != seqs[0] - 1 or self._redeliver or self._fatal is not None
                or len(self._producer) >= self._max_in_flight):
            return errors  # the poller hands them over from the spool, after the older ones (or when there is room)
        # The common case inline (no per-message method call: this loop is most of send's cost);
        # anything unusual, and every exception, takes the general path of _produce().
        produce, partial, report, generation = self._producer.produce, functools.partial, self._report, self._generation
        limits = self._max_bytes
        upto = self._dispatched_upto
        try:
            for row, seq in zip(rows, seqs, strict=True):
                message_id, topic, value, key, headers, partition = row
                limit = limits.get(topic)
                if partition is None and not headers and (
                        limit is None or (len(value) if value else 0) + (len(key) if key else 0) + 4096 <= limit):
                    try:
                        # Positional (see _produce): a keyword argument costs ~1 µs per call.
                        produce(topic, value, key, -1, partial(report, seq, generation, topic), None, 0,
                                [(ID_HEADER, message_id.encode())])
                        upto = seq
                        continue
                    except (BufferError, KafkaException):
                        pass  # _produce() below says what it means
                outcome = self._produce(row, seq)
                if outcome is False:
                    return errors  # librdkafka's queue is full: the poller goes on from here
                if outcome is not True:
                    errors[seq] = outcome
                upto = seq
            return errors
        finally:
            self._dispatched_upto = upto

    def _produce(self, row: NewMessage | OutboxRow, seq: int) -> bool | str:
        """True when librdkafka took it, False when its queue is full, a reason when refused for good."""
        topic, value, key = row.topic, row.value, row.key
        limit = self._max_bytes.get(topic)
        if limit is not None and len(value or b"") + len(key or b"") + 4096 > limit:
            oversized = self._too_large(topic, value, key, row.headers)
            if oversized is not None:
                self._fail(seq, oversized)
                return oversized
        headers: list[tuple[str, str | bytes | None]] = [(ID_HEADER, row.message_id.encode()), *row.headers]
        callback = functools.partial(self._report, seq, self._generation, topic)
        try:
            # produce(topic, value, key, partition, callback, on_delivery, timestamp, headers), all
            # positional: confluent-kafka parses keyword arguments at ~1 µs each, as much as the rest
            # of the call (-1: librdkafka's partitioner picks; 0: the current time).
            self._producer.produce(topic, value, key, -1 if row.partition is None else row.partition, callback,
                                   None, 0, headers)
            return True
        except BufferError:
            return False
        except KafkaException as exc:
            disposition = classify(exc)
            reason = describe(exc)
            if disposition is Disposition.PERMANENT:
                self._fail(seq, reason)
                return reason
            if disposition is Disposition.FATAL:
                self._fatal = exc.args[0]
                return False
            log.warning("produce of seq %d refused for now (%s); it will be retried", seq, reason)
            self._redeliver.append(seq)
            return True

    def _dispatch_backlog(self) -> None:
        """Poller: hand over spooled rows librdkafka has not got yet, in seq order."""
        if not self._redeliver and self._dispatched_upto >= self._last_seq:
            # Nothing waits (read without the lock: a send in progress is dispatching its own rows, and
            # anything it leaves behind is seen next round). Taking the lock here made every poll round
            # wait for the send in progress, and with it the delivery reports.
            return
        with self._send_lock:
            # Only the seqs queued before this round: a retriable refusal re-queues at the back.
            for _ in range(len(self._redeliver)):
                seq = self._redeliver[0]
                r = self._spool.get(seq)
                if r is not None and r.state == "pending" and self._produce(r, seq) is False:
                    return
                self._redeliver.popleft()
            while self._dispatched_upto < self._last_seq:
                if len(self._producer) >= self._max_in_flight:
                    return  # the rest waits in the spool: librdkafka's copies cost memory
                rows = self._spool.pending(after_seq=self._dispatched_upto, limit=_DISPATCH_PAGE)
                if not rows:
                    self._dispatched_upto = self._last_seq
                    return
                for r in rows:
                    if self._produce(r, r.seq) is False:
                        return
                    self._dispatched_upto = r.seq

    # ---- delivery reports and the poller thread -------------------------------------------

    def _on_delivery(self, seq: int, generation: int, topic: str, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            # A success is real whatever producer instance reported it.
            self._delivered.append(seq)
            return
        if generation != self._generation:
            return  # purged from a replaced producer: the whole spool is being re-sent anyway
        disposition = classify(err)
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE and not self._refused_for_size(topic, seq):
            disposition = Disposition.RETRIABLE  # it fits alone: it shared a batch with an oversized record
        if disposition is Disposition.PERMANENT:
            self._fail(seq, describe(err))
        elif disposition is Disposition.FATAL:
            self._fatal = err
        else:
            # Unknown outcome (e.g. _MSG_TIMED_OUT): send again; the rk-id makes a duplicate recognisable.
            self._counts["retried"] += 1
            telemetry.retries.add(1)
            self._spool.record_attempt([seq], describe(err))
            self._redeliver.append(seq)

    def _fail(self, seq: int, reason: str) -> None:
        self._spool.mark_failed(seq, reason)
        self._counts["failed"] += 1
        telemetry.messages_failed.add(1)
        log.error("message seq %d refused by Kafka for good (%s); kept in the outbox as failed", seq, reason)
        if self._on_failed is not None:
            for row in self._spool.failed():
                if row.seq == seq:
                    self._on_failed(row)
                    break

    def _apply_reports(self) -> None:
        if self._delivered:
            done, self._delivered = self._delivered, []
            self._last_progress = time.monotonic()
            self._spool.mark_delivered(done)
            self._counts["delivered"] += len(done)
            telemetry.messages_delivered.add(len(done))
            with self._settled:
                self._settled.notify_all()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._producer.poll(0.05)
                self._apply_reports()
                if not len(self._producer):
                    self._last_progress = time.monotonic()  # nothing in flight is not a stall
                if self._fatal is not None:
                    self._recreate()
                self._dispatch_backlog()
                if self._deferred_topics:
                    self._retry_deferred_preflights()
                with self._settled:
                    self._settled.notify_all()
            except Exception:  # the poller must outlive any one bad round, or nothing gets confirmed
                log.exception("producer poll round failed; continuing")
                time.sleep(0.5)
        # Final reports: everything librdkafka has confirmed by now is removed from the spool.
        self._producer.poll(0)
        self._apply_reports()

    def _recreate(self) -> None:
        """Rebuild the librdkafka producer after a fatal error and re-send the spool in order (L5)."""
        with self._send_lock:
            reason = self._fatal
            old = self._producer
            self._generation += 1
            try:
                old.purge(in_queue=True, in_flight=True)
                old.poll(0)  # successes among the purged reports still count
            except KafkaException:
                pass
            self._apply_reports()
            self._producer = self._new_producer()
            self._fatal = None
            self._redeliver.clear()
            self._dispatched_upto = 0
            self._last_seq = max(self._last_seq, self._max_pending_seq())
            self._counts["recreated"] += 1
            log.warning("idempotent producer hit a fatal error (%s); recreated it and re-sending the outbox",
                        describe(reason) if reason is not None else "unknown")

    def _max_pending_seq(self) -> int:
        last = 0
        after = 0
        while True:
            rows = self._spool.pending(after_seq=after, limit=_DISPATCH_PAGE)
            if not rows:
                return last
            last = rows[-1].seq
            after = last

    def _new_producer(self) -> Producer:
        conf = dict(self._config)
        conf["error_cb"] = self._on_error
        conf.setdefault("logger", _rdkafka_log)
        return Producer(conf)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
        elif err.code() == KafkaError._ALL_BROKERS_DOWN:
            log.warning("all brokers are down; messages stay in the outbox until they are back")
        else:
            log.debug("producer: %s", describe(err))
