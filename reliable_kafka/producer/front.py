"""ReliableProducer: acks=all + idempotence behind a disk-spooled outbox.

send() returns once the message is durable in the outbox (per the durability mode); a message
leaves the outbox only when librdkafka reports it persisted by all in-sync replicas, or moves to
`failed` with the broker's reason. Nothing is dropped: not on a full buffer, not on a crash, not
after an idempotent-producer fatal error (the producer is rebuilt and the outbox re-sent in order).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from reliable_kafka import telemetry
from reliable_kafka.config import producer_config
from reliable_kafka.deprecation import renamed, warn_deprecated
from reliable_kafka.errors import ConfigError, DeliveryFailed, ProducerClosed
from reliable_kafka.ids import new_id, new_ids
from reliable_kafka.outbox import Outbox
from reliable_kafka.outbox.pool import OutboxPool
from reliable_kafka.producer.adopter import SlotAdopter
from reliable_kafka.producer.dispatcher import Dispatcher
from reliable_kafka.producer.group_commit import MAX_BATCH, GroupCommit
from reliable_kafka.producer.messages import Headers, Message, Preparer, Sent, new_tuple, plain_rows
from reliable_kafka.producer.send_spans import SendSpans
from reliable_kafka.producer.topic_guard import TopicGuard
from reliable_kafka.serdes import UserSerializer
from reliable_kafka.spool import Durability, MemorySpool, NewMessage, OutboxRow, Spool
from reliable_kafka.stats import Stats

log = logging.getLogger(__name__)


def _check_config(config: Mapping[str, Any]) -> None:
    for owned in ("on_delivery", "dr_msg_cb", "dr_cb"):
        if owned in config:
            raise ConfigError(owned, "ReliableProducer owns delivery reports (they clear the outbox); use "
                                     "on_failed=, wait() or state() to follow a message")
    if str(config.get("delivery.report.only.error", "false")).strip().lower() in ("true", "1"):
        # (The Spark writer sets it on its own producers: it learns of success from flush() instead.)
        raise ConfigError("delivery.report.only.error",
                          "true hides successful deliveries, so a message could never leave the outbox")


def _open_spool(
    durability: Durability,
    outbox_path: str | os.PathLike[str] | None,
    outbox_dir: str | os.PathLike[str] | None,
    max_pending: int,
) -> tuple[Spool, Path | None, OutboxPool | None]:
    """The spool, its file, and the pool it was claimed from when the outbox is a slot of `outbox_dir`."""
    if outbox_path is not None and outbox_dir is not None:
        raise ConfigError("outbox_dir", "give outbox_path (one file for this process) or outbox_dir (a pool "
                                        "of slot files shared by several processes), not both")
    if durability is Durability.MEMORY:
        if outbox_path is not None:
            raise ConfigError("outbox_path", "durability='memory' keeps no outbox file; drop the path")
        if outbox_dir is not None:
            raise ConfigError("outbox_dir", "durability='memory' keeps no outbox file; drop the directory")
        return MemorySpool(max_pending), None, None
    if outbox_dir is not None:
        pool = OutboxPool(outbox_dir)
        slot = pool.claim(durability=durability, max_messages=max_pending)
        return slot, slot.path, pool
    if outbox_path is None:
        raise ConfigError("outbox_path", f"durability={durability.value!r} needs an outbox file to spool to "
                                         "(outbox_path=), or a pool directory shared by several processes "
                                         "(outbox_dir=)")
    outbox = Outbox(Path(outbox_path), durability=durability, max_messages=max_pending)
    return outbox, outbox.path, None


class ReliableProducer:
    """A Kafka producer that does not lose accepted messages.

    Args:
        config: librdkafka settings (at least bootstrap.servers); unsafe ones raise ConfigError.
        outbox_path: the SQLite outbox file of this process (required unless durability="memory" or
            outbox_dir is given).
        outbox_dir: instead of outbox_path, a directory shared by the processes of one server: this
            process owns a free slot file in it, and drains the slots that dead or retired processes
            left with pending messages (docs/producer.md#several-processes-the-outbox-pool).
        durability: "process" (survives a crash of this process), "fsync" (survives power loss),
            or "memory" (no spool: still acks=all + idempotent, but a crash loses unconfirmed messages).
        max_pending: spool bound; a full spool makes send() block up to `send_timeout_s`, then raise OutboxFull.
        max_in_flight: how many messages librdkafka may hold at once (its copies cost ~700 bytes of RSS
            each). Beyond it send() waits while brokers keep confirming, like a full librdkafka queue;
            while they confirm nothing (they are away), the rest waits in the outbox instead. Senders
            that passed the wait together may take librdkafka up to 1.25 x the bound.
        preflight: "error" (default) refuses topics whose replication cannot keep acks=all durable,
            "warn" logs it, "off" skips the check.
        on_failed: called with the OutboxRow of each message Kafka refused for good.
        value_serializer, key_serializer: turn a value / key that is not bytes into bytes: a function
            `f(obj) -> bytes`, or a confluent-kafka Serializer (Schema Registry's AvroSerializer,
            JSONSerializer, ProtobufSerializer), called with SerializationContext(topic, field, headers).

    It composes parts that each own their state: the spool (outbox.py or spool.py), the topic guard
    (topic_guard.py: preflight, size limits, the AdminClient), the dispatcher (dispatcher.py: the
    librdkafka producer, hand-over order, the poller thread, delivery reports, rebuild after fatal errors)
    and the group commit (group_commit.py: concurrent send() calls share one outbox transaction).
    A send is two steps every front end calls: prepare (serialize, validate, preflight an unseen topic)
    and accept (one outbox transaction and the hand-over to librdkafka).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        outbox_path: str | os.PathLike[str] | None = None,
        outbox_dir: str | os.PathLike[str] | None = None,
        durability: Durability | str = Durability.PROCESS,
        max_pending: int = 1_000_000,
        max_in_flight: int = 20_000,
        send_timeout_s: float = 30.0,
        preflight: str = "error",
        value_serializer: UserSerializer | None = None,
        key_serializer: UserSerializer | None = None,
        on_failed: Callable[[OutboxRow], None] | None = None,
        send_timeout: float | None = None,  # deprecated: send_timeout_s
    ) -> None:
        send_timeout_s = renamed("ReliableProducer", "send_timeout", send_timeout,
                                 "send_timeout_s", send_timeout_s, 30.0)
        conf = producer_config(config)
        _check_config(conf)
        self.durability = Durability(durability)
        if preflight not in ("error", "warn", "off"):
            raise ConfigError("preflight", f"{preflight!r} is not 'error', 'warn' or 'off'")
        if max_in_flight < 1:
            raise ConfigError("max_in_flight", f"must be at least 1, got {max_in_flight}")
        self._spool, self._outbox_path, pool = _open_spool(self.durability, outbox_path, outbox_dir, max_pending)
        self._closed = False
        self._tracing = telemetry.tracing_enabled()
        spans = SendSpans() if self._tracing else None
        self._prepare_row = Preparer(value_serializer, key_serializer, spans=spans).prepare
        self._guard = TopicGuard(conf, preflight)
        self._seen_topics = self._guard.seen  # read per send without a call (see _prepare)
        self._dispatcher = Dispatcher(conf, self._spool, self._guard, max_in_flight=max_in_flight,
                                      send_timeout_s=send_timeout_s, on_failed=on_failed, spans=spans)
        # Capped at the spool bound too: a combined batch must fit wherever each of its messages would.
        self._accept_one = self._dispatcher.accept_one  # bound once: send()'s call (see the dispatcher's)
        self._group = GroupCommit(self._dispatcher.accept, max_batch=max(1, min(MAX_BATCH, max_pending)))
        # An outbox whose single appends are journal records (durability "process") needs no group commit:
        # an append no longer waits for a commit, so each send() accepts its own message on its own
        # thread, and concurrent senders never wait to be woken (outbox/journal.py says why). Nor does the
        # memory spool, which has no commit at all: through the group commit a "memory" send() cost ~5.7 us
        # of CPU from one thread and ~6.4 us from 16, inline ~4.3 and ~4.5 (librdkafka mock, interleaved).
        self._accept_inline = isinstance(self._spool, MemorySpool) or (
            isinstance(self._spool, Outbox) and self._spool.journaled)
        self._started = False
        # _prepare_call()'s plain case may skip _ready(): started, not closed, not tracing (one check, not three).
        self._plain_ready = False
        # The slots of an outbox_dir that dead or retired processes left pending are drained by ordinary
        # producers opened on them, with this one's settings (a slot holds serialized rows: no serializers).
        self._adopter: SlotAdopter | None = None
        if pool is not None and (slot_file := self._outbox_path) is not None:
            self._adopter = SlotAdopter(pool, slot_file, lambda slot: ReliableProducer(
                config, outbox_path=slot, durability=self.durability, max_pending=max_pending,
                max_in_flight=max_in_flight, send_timeout_s=send_timeout_s, preflight=preflight,
                on_failed=on_failed))

    # ---- lifecycle (docs/api.md#lifecycle: the same rule for every client) --------------------

    def start(self) -> ReliableProducer:
        """Start delivering (idempotent): what an earlier run left in the outbox goes out first.

        `with`, and the first send(), send_many(), flush(), wait() or close(), call it for you.
        """
        if self._closed:
            raise ProducerClosed("this ReliableProducer was closed; create a new one")
        if not self._started:
            self._started = True
            self._plain_ready = not self._tracing
            telemetry.register_producer(self, self.durability.value, self._spool.stats)
            left = self._dispatcher.start()
            if left:
                # Whatever a previous run left pending goes out first, in its original order.
                log.info("re-sending %d pending message(s) from %s", left, self._outbox_path)
            if self._adopter is not None:
                self._adopter.start()  # its own thread: send() never waits for an adoption
        return self

    # ---- sending ---------------------------------------------------------------------------

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

        In durability "process" the message is one record in the outbox's accept journal, written on the
        caller's thread ("memory": kept in memory, likewise on the caller's thread). In "fsync", concurrent
        send() calls from several threads share one outbox transaction (group commit), each returning when
        the transaction holding its own message committed.

        Raises OutboxFull when the spool stayed full for send_timeout_s, TopicConfigError when the
        preflight refuses the topic, SerializationError for a value that is not bytes, and
        DeliveryFailed when Kafka refused it at once (it is then kept in the outbox as failed).
        """
        row = self._prepare_call(topic, value, key, headers, partition, message_id)
        if self._accept_inline:
            if self._closed:
                raise ProducerClosed("send after close(): create a new ReliableProducer")
            seq, error = self._accept_one(row)
            return self._sent_one(row, seq, error)
        seq, error = self._group.submit(row)
        return self._sent_one(row, seq, error)

    def send_many(self, messages: Iterable[Message | tuple[str, Any]]) -> list[Sent]:
        """Accept a batch in one outbox transaction (much faster than send() in a loop).

        Returns a Sent per message, in order; a message Kafka refused at once has `error` set.
        """
        return self._accept(self._prepare(messages))

    # The two steps of a send, shared by the front ends (this one and producer/aio.py).

    def _ready(self) -> None:
        if self._closed:
            raise ProducerClosed("send after close(): create a new ReliableProducer")
        if not self._started:
            self.start()

    def _prepare(self, messages: Iterable[Message | tuple[str, Any]]) -> list[NewMessage]:
        """Step 1 of send_many(): rows for the spool, every unseen topic preflighted. Nothing is stored:
        a refusal (SerializationError, ConfigError, TopicConfigError) leaves the outbox as it was.
        May block on a topic's first send (the preflight's admin requests)."""
        self._ready()
        batch = messages if isinstance(messages, list) else list(messages)
        if not batch:
            return []
        ids = new_ids(len(batch))
        rows = None if self._tracing else plain_rows(batch, ids)
        if rows is None:
            prepare = self._prepare_row
            rows = [prepare(m, i) for m, i in zip(batch, ids, strict=True)]
        for topic in {r.topic for r in rows} - self._seen_topics:
            self._guard.preflight(topic)
        return rows

    def _prepare_call(self, topic: str, value: Any, key: Any, headers: Headers, partition: int | None,
                      message_id: str | None) -> NewMessage:
        """Step 1 of send(): its arguments as a row. The plain case (bytes to a topic already checked, no
        headers, partition or id, no tracing) is a tuple and an id; building the Message and running the
        Preparer for it was a quarter of a memory-mode send() (~4 of 16 us CPU, dead-broker harness)."""
        if (type(value) is bytes and headers is None and partition is None and message_id is None
                and (key is None or type(key) is bytes) and self._plain_ready and type(topic) is str
                and topic in self._seen_topics):
            return new_tuple(NewMessage, (new_id(), topic, value, key, (), None))
        return self._prepare_one(Message(topic, value, key, headers, partition, message_id))

    def _prepare_one(self, message: Message) -> NewMessage:
        """Step 1 of send(): _prepare() for one Message, without a batch's list, id batch or set
        (and without plain_rows(), whose TypeError on a Message cost ~40 us a send under cProfile)."""
        self._ready()
        row = self._prepare_row(message, new_id())
        if row.topic not in self._seen_topics:
            self._guard.preflight(row.topic)
        return row

    def _accept(self, rows: list[NewMessage]) -> list[Sent]:
        """Step 2 of send_many(): one outbox transaction and the hand-over to librdkafka."""
        if not rows:
            return []
        errors: dict[int, str] = {}
        seqs = self._dispatcher.accept(rows, errors)
        if errors:
            return [Sent(r.message_id, s, errors.get(s)) for r, s in zip(rows, seqs, strict=True)]
        return [new_tuple(Sent, (r[0], s, None)) for r, s in zip(rows, seqs, strict=True)]

    @staticmethod
    def _sent_one(row: NewMessage, seq: int, error: str | None) -> Sent:
        """Step 2 of send(), after its (group) commit: the Sent, or DeliveryFailed for a refusal at once."""
        if error is not None:
            raise DeliveryFailed(row.message_id, error, topic=row.topic, partition=row.partition)
        return new_tuple(Sent, (row[0], seq, None))

    def check_topics(self, topics: Iterable[str]) -> None:
        """Run the preflight for `topics` now (it otherwise runs on the first send to each topic).

        Raises TopicConfigError (preflight="error") for a topic whose replication cannot keep acks=all
        durable, and ClusterUnreachable when no broker answers.
        """
        self._guard.check(topics)

    # ---- waiting and closing ---------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every accepted message is delivered or failed; returns how many are still pending."""
        if not self._started and not self._closed:
            self.start()
        return self._dispatcher.wait_until(lambda: self._spool.stats().pending, lambda n: n == 0, timeout, 0.1)

    def wait(self, sent: Sent, timeout: float | None = None) -> str:
        """Wait until one message is delivered or failed (or `timeout`); returns its state."""
        if not self._started and not self._closed:
            self.start()
        return self._dispatcher.wait_until(lambda: self.state(sent), lambda s: s != "pending", timeout, 0.05)

    def close(self, timeout: float | None = 30.0) -> int:
        """Stop accepting, deliver what is pending within `timeout`, release the outbox.

        Returns the number still pending. In a spooled mode they stay in the outbox and are sent
        on the next start; in memory mode they are lost, which is logged as an error.
        """
        if self._closed:
            return 0
        self.start()  # a producer never used still delivers what an earlier run left, within `timeout`
        self._plain_ready = False
        self._closed = True
        telemetry.unregister_producer(self)
        # What concurrent send() calls queued before this is committed (and so flushed below) or refused.
        self._group.close(timeout)
        self.flush(timeout)
        if self._adopter is not None:
            self._adopter.close()  # what it has not delivered stays in its slot for the next adopter
        remaining = self._dispatcher.stop()
        if remaining:
            if self.durability is Durability.MEMORY:
                log.error("closing with %d undelivered message(s) in memory mode: they are lost", remaining)
            else:
                log.warning("closing with %d undelivered message(s); they stay in the outbox for the next start",
                            remaining)
        self._spool.close()
        self._guard.close()
        return remaining

    def __enter__(self) -> ReliableProducer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- inspecting ------------------------------------------------------------------------

    def state(self, sent: Sent) -> str:
        """"pending", "delivered" or "failed" for a message this producer accepted."""
        row = self._spool.get(sent.seq)
        return "delivered" if row is None else row.state

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
        return self._dispatcher.in_flight

    @property
    def oldest_pending_age_s(self) -> float | None:
        """Seconds since the oldest unconfirmed message was accepted (None when nothing is pending)."""
        return self._spool.stats().oldest_pending_age_s

    def stats(self) -> Stats:
        """What this producer did so far: sent, delivered, failed, retried, recreated, commits.

        An immutable snapshot: `stats().delivered` or `stats()["delivered"]`; every name is there from the start.
        """
        self._dispatcher.publish_sent()
        return self._dispatcher.counters.stats()

    @property
    def counts(self) -> dict[str, int]:
        """Deprecated: stats() has the same counts (as attributes too)."""
        warn_deprecated("ReliableProducer.counts", "use ReliableProducer.stats()", stacklevel=2)
        return dict(self.stats())
