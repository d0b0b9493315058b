"""TransactionalProcessor: exactly-once consume-transform-produce from Kafka topics to Kafka topics.

Guarantee: the outputs of a batch and the offsets of the inputs that produced them commit in one Kafka
transaction, so through crashes, rebalances and broker failures every input record's outputs (or its
dead-letter copy) become visible to read_committed readers exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, KafkaException, Message, TopicPartition

from reliable_kafka import kafka_errors, rdkafka_stats, telemetry
from reliable_kafka.config import consumer_config, transactional_producer_config
from reliable_kafka.consumer.rebalance import leave_before_close
from reliable_kafka.deprecation import renamed
from reliable_kafka.dlq import DeadLetterPolicy
from reliable_kafka.errors import ClientClosed, ConfigError, RetryInterrupted
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.serdes import UserDeserializer, UserSerializer
from reliable_kafka.stats import Stats
from reliable_kafka.transactions.calls import Deadlines, Failure
from reliable_kafka.transactions.checkpoint import COMMIT_CHECK_S, Checkpoint, CommitInfo, Outcome
from reliable_kafka.transactions.coding import coded
from reliable_kafka.transactions.failures import TransformFailures
from reliable_kafka.transactions.records import (
    Batch,
    MapValues,
    OutHeaders,
    OutputRecord,
    Outputs,
    TopicPartitionKey,
    Transform,
    check_output,
    has_id,
    header_list,
    input_id,
)
from reliable_kafka.transactions.steps import TxnStep

log = logging.getLogger("reliable_kafka.transactions")
_rdkafka_log = logging.getLogger("reliable_kafka.rdkafka")
_DEAD_LETTER = DeadLetterPolicy()  # the default: "{topic}.dlq"

# How long consume() blocks while no transaction is open: bounds how late stop() is noticed.
_IDLE_POLL_S = 0.1
# Records asked from librdkafka per consume() call; a transaction may span several calls.
_CONSUME_CHUNK = 500
# A transform is retried while its transaction stays open and every partition waits: briefly, by default.
DEFAULT_RETRY_POLICY = RetryPolicy(attempts=3, initial_backoff_s=0.1, max_backoff_s=1.0)


class TransactionalProcessor:
    """Consumes `input_topics` in a consumer group, transforms each record, and commits the outputs
    together with the consumed offsets in one transaction per batch.

    A batch closes after `max_batch_messages` records (100,000) or `max_batch_interval_s` seconds (100
    ms by default), whichever comes first. While a batch commits, the next one is already consumed and
    transformed, up to `max_batch_messages` records, and its outputs are written once the commit is
    through. Why the bound is that high: a commit's fixed cost (its offsets, its end marker) is paid
    per transaction, and while the backlog is full the loop waits; copying 5M records, 100,000 against
    20,000 cut the loop's waiting from ~33 % to 9 % of its time (benchmarks/eos_commit_probe.py). It
    only binds at high rates: a transaction of slower input closes on the interval. Outputs carry a
    deterministic `rk-id`. A record whose transform keeps failing (per `retry`) is written to its dead-letter
    topic (`dead_letter`, default "<topic>.dlq", which must exist) inside the same transaction, and
    processing goes on.

    `transactional_id` must be stable for this instance and unique among live instances (e.g.
    "<app>-<pod ordinal>"): a restart with the same id fences its previous incarnation and aborts
    what it left open. Zombies that lost their partitions are fenced through the consumer group's
    metadata (KIP-447, brokers >= 2.5), so the id need not follow partition assignment.

    Use as a context manager: `with TransactionalProcessor(...) as p: p.run()`. `stop()` (safe from
    a signal handler) makes run() commit what is processed and return. Fatal errors stop the
    instance: TransactionFenced when another instance took over, TransactionFailed otherwise.

    It wires the parts that own the work: the checkpoint (checkpoint.py: the transaction's state and
    steps), the transform's failure stages (failures.py: retry, dead letter) and the committer thread
    (committer.py); what it keeps is the consume loop, the rebalance callbacks and the lifecycle.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        input_topics: Sequence[str],
        transform: Transform,
        transactional_id: str,
        consumer_overrides: Mapping[str, Any] | None = None,
        producer_overrides: Mapping[str, Any] | None = None,
        max_batch_messages: int = 100_000,
        max_batch_interval_s: float = 0.1,
        retry: RetryPolicy | None = None,
        dead_letter: DeadLetterPolicy | None = None,
        operation_timeout_s: float = 30.0,
        stop_timeout_s: float = 45.0,
        on_commit: Callable[[CommitInfo], None] | None = None,
        group_id: str | None = None,
        value_deserializer: UserDeserializer | None = None,
        key_deserializer: UserDeserializer | None = None,
        value_serializer: UserSerializer | None = None,
        key_serializer: UserSerializer | None = None,
        retry_policy: RetryPolicy | None = None,  # deprecated: retry
        dlq_topic: str | None = None,  # deprecated: dead_letter=DeadLetterPolicy(template=...)
    ) -> None:
        """Validate the settings; nothing connects until start() (or run(), or `with`).

        `config` holds settings shared by the consumer and the producer (bootstrap.servers, security)
        and the consumer group's `group.id`, as for ReliableConsumer; `consumer_overrides` /
        `producer_overrides` hold settings for one of them only. Unsafe settings (auto-commit,
        read_uncommitted, acks other than all, ...) raise ConfigError. `operation_timeout_s` bounds each
        transactional call; retriable failures are retried for up to twice that. `stop_timeout_s` bounds
        a graceful stop: what cannot be committed by then (a coordinator still moving, say) is given up,
        never lost: its input offsets stay uncommitted and the next owner processes those records again.
        `retry` retries a failing transform (default: 3 attempts, 0.1-1 s apart) before its record is
        dead-lettered to `dead_letter.template` (default "{topic}.dlq") inside the transaction; the
        policy's producer settings and timeouts do not apply here, since the processor's own
        transactional producer writes the dead letter. `on_commit` is called after each committed
        transaction, in the run() thread. `group_id=`, `retry_policy=` and `dlq_topic=` are the deprecated
        spellings of `group.id` in `config`, `retry=` and `dead_letter=DeadLetterPolicy(template=...)`.

        `value_deserializer` / `key_deserializer` decode each input before the transform sees it, and
        `value_serializer` / `key_serializer` encode the outputs' values / keys that are not bytes: plain
        functions, or confluent-kafka (Schema Registry) Deserializer / Serializer objects, called with
        SerializationContext(topic, field, headers) as in ReliableConsumer and ReliableProducer. A record
        that cannot be decoded, or whose outputs cannot be encoded, fails like its transform: retried, then
        dead-lettered with the bytes it was consumed with.
        """
        retry = renamed("TransactionalProcessor", "retry_policy", retry_policy, "retry", retry, None)
        template = (dead_letter or _DEAD_LETTER).template
        if dlq_topic is not None:
            policy = renamed("TransactionalProcessor", "dlq_topic", DeadLetterPolicy(template=dlq_topic),
                             "dead_letter", dead_letter, None)
            template = (policy or _DEAD_LETTER).template
        if isinstance(input_topics, str) or not input_topics:
            raise ConfigError("input_topics", "must be a non-empty list of topic names")
        for key in ("transactional.id", "enable.auto.commit", "isolation.level"):
            if key in config:
                raise ConfigError(key, "is the processor's to set (transactional_id is an argument)")
        group = _group_of(config, consumer_overrides, group_id)
        if not isinstance(max_batch_messages, int) or max_batch_messages < 1:
            raise ConfigError("max_batch_messages", f"must be an integer >= 1, got {max_batch_messages!r}")
        if not max_batch_interval_s > 0:
            raise ConfigError("max_batch_interval_s", f"must be > 0, got {max_batch_interval_s!r}")
        if not operation_timeout_s > 0:
            raise ConfigError("operation_timeout_s", f"must be > 0, got {operation_timeout_s!r}")
        if not stop_timeout_s > 0:
            raise ConfigError("stop_timeout_s", f"must be > 0, got {stop_timeout_s!r}")
        common = {k: v for k, v in config.items() if k != "group.id"}
        self._consumer_conf = consumer_config({**common, "group.id": group, **dict(consumer_overrides or {})})
        producer_conf = transactional_producer_config({**common, **dict(producer_overrides or {})}, transactional_id,
                                                      commit_interval_s=max_batch_interval_s)
        self._consumer_conf.setdefault("logger", _rdkafka_log)
        producer_conf.setdefault("logger", _rdkafka_log)
        reset = str(self._consumer_conf["auto.offset.reset"]).lower()
        self._input_topics = list(input_topics)
        # The (de)serializers wrapped around the transform once, here: without them it is the transform.
        transform = coded(transform, value_deserializer=value_deserializer, key_deserializer=key_deserializer,
                          value_serializer=value_serializer, key_serializer=key_serializer)
        self._transform = transform
        # A MapValues with no (de)serializers around it has a path of its own in the loop (see MapValues).
        self._mapped = (transform.fn, transform.topic) if isinstance(transform, MapValues) else None
        self._group_id = group
        # Looked up once: with no OpenTelemetry SDK installed the hot path stays free of span calls.
        self._tracing = telemetry.tracing_enabled()
        self._transactional_id = transactional_id
        self._deadlines = Deadlines(operation_timeout_s, stop_timeout_s)
        # The thread inside run(), so that close() from another thread stops it before tearing down.
        self._runner: threading.Thread | None = None
        self._consumer: Consumer | None = None
        self._stopping = threading.Event()
        self._closed = False
        self._failures = TransformFailures(
            transform, retry if retry is not None else DEFAULT_RETRY_POLICY, template,
            self._input_topics, self._stopping,
        )
        self._checkpoint = Checkpoint(
            producer_conf, transactional_id=transactional_id, group_id=group, max_batch_messages=max_batch_messages,
            interval_s=max_batch_interval_s, deadlines=self._deadlines,
            # Where a rewind goes for a partition that has no committed offset yet.
            reset_to=OFFSET_END if reset in ("latest", "largest", "end") else OFFSET_BEGINNING,
            stopping=self._stopping, on_refused=self._failures.output_refused, on_commit=on_commit,
        )

    # ---- public API --------------------------------------------------------------------------

    def start(self) -> TransactionalProcessor:
        """Initialise the transactional producer and join the consumer group (idempotent)."""
        if self._closed:
            raise ClientClosed("this TransactionalProcessor was closed; create a new one")
        if self._checkpoint.broken is not None:
            raise self._checkpoint.broken
        if self._consumer is not None:
            return self
        # The producer first: init_transactions fences an earlier incarnation of this transactional.id
        # and aborts what it left open, so the committed offsets the consumer reads next are settled.
        self._checkpoint.start()
        conf = dict(self._consumer_conf)
        if (stats_cb := rdkafka_stats.collector(conf, "consumer")) is not None:
            conf["stats_cb"] = stats_cb
        consumer = Consumer(conf)
        consumer.subscribe(
            self._input_topics, on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        self._consumer = self._checkpoint.consumer = consumer
        log.info("transactional processor %r started on %s", self._transactional_id, self._input_topics)
        return self

    def run(self) -> Stats:
        """Process records until stop() is called, then commit what is processed and return stats().

        Raises TransactionFenced (another instance with the same transactional.id took over),
        TransactionFailed (a fatal error) or DeadLetterFailed (a poison record could not be parked);
        in each case nothing of the open transaction becomes visible.
        """
        self.start()
        self._runner = threading.current_thread()
        try:
            try:
                while not self._stopping.is_set():
                    self._poll_once()
            except RetryInterrupted as exc:
                # stop() came while a transform waited to retry: that record stays unprocessed (and
                # uncommitted); what was finished before it is committed below.
                log.info("stopped while retrying a transform: %s", exc)
            self.stop()  # starts the stop's clock if the loop ended some other way
            self._checkpoint.settle("stop requested")
        finally:
            self._runner = None
        return self.stats()

    def stop(self) -> None:
        """Ask run() to commit what is processed and return within stop_timeout_s. Safe from signal
        handlers and threads."""
        self._deadlines.start_stop()
        self._stopping.set()

    def close(self) -> None:
        """Leave the consumer group and release the clients.

        A commit already under way is completed; the open transaction is aborted and its records are
        processed again by the next owner. Call stop() and let run() return to commit them instead.
        """
        if self._closed:
            return
        runner = self._runner
        if runner is not None and runner is not threading.current_thread():
            # run() is active in another thread: tearing the clients down under it could leave a
            # transaction open (holding back read_committed readers). Stop it first; its stop is bounded.
            self.stop()
            limit = self._deadlines.stop_timeout_s + self._deadlines.operation_timeout_s
            runner.join(limit)
            if runner.is_alive():
                log.warning("run() did not return within %.0fs of stop(); closing anyway", limit)
        self._closed = True
        self.stop()
        try:
            self._checkpoint.close()
        finally:
            consumer, self._consumer = self._consumer, None
            if consumer is not None:
                # Nothing is left to commit on revoke (closed: _on_revoke only forgets), but the revoke
                # must still run before the client's close, not inside it (see leave_before_close).
                leave_before_close(consumer, self._consumer_conf, lambda: bool(self._checkpoint.owned),
                                   self._deadlines.operation_timeout_s)
                consumer.close()
            self._checkpoint.shutdown()

    def stats(self) -> Stats:
        """What this processor did so far: transactions_committed, messages_committed, dead_lettered, ...

        An immutable snapshot: `stats().messages_committed` or `stats()["messages_committed"]`; every
        name is there from the start.
        """
        return self._checkpoint.counters.stats()

    @property
    def transactional_id(self) -> str:
        return self._transactional_id

    def __enter__(self) -> TransactionalProcessor:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- the loop ----------------------------------------------------------------------------

    def _poll_once(self) -> None:
        consumer, checkpoint = self._consumer, self._checkpoint
        assert consumer is not None
        # The backlog is bounded by the batch size: when it is full, wait for the commit.
        if (checkpoint.committing is not None
                and checkpoint.reap(wait=checkpoint.backlog.messages >= checkpoint.max_batch) is Outcome.REWOUND):
            return  # after a rewind the records at hand are stale
        if checkpoint.committing is not None:
            # Look again soon: the backlog is written as soon as the commit is through.
            wait, room = COMMIT_CHECK_S, checkpoint.max_batch - checkpoint.backlog.messages
        elif checkpoint.open:
            wait = max(0.0, checkpoint.deadline - time.monotonic())
            room = checkpoint.max_batch - checkpoint.messages
        else:
            wait, room = _IDLE_POLL_S, checkpoint.max_batch
        # A rebalance callback inside consume() may seek (a rewind) or reassign: librdkafka drops the
        # records it had fetched before that (its version barrier), so what comes back is current.
        msgs = consumer.consume(num_messages=max(1, min(room, _CONSUME_CHUNK)), timeout=wait)
        outcome = self._process_batch(msgs) if msgs else checkpoint.add(Batch())
        if outcome is not Outcome.REWOUND and checkpoint.committing is None and checkpoint.open:
            checkpoint.client.serve_reports()  # so they do not pile up

    def _process_batch(self, msgs: list[Message]) -> Outcome:
        # The per-record hot path: plain locals, no helper calls unless something is unusual. Processed
        # records are handed over (written, or queued behind a running commit) in bulk, at the end of the
        # batch or when a deadline passes (a slow transform can make one batch outlast the interval).
        checkpoint, failures = self._checkpoint, self._failures
        owned, positions, refused, now = checkpoint.owned, checkpoint.positions, failures.refused, time.monotonic
        transform = self._transform_traced if self._tracing else self._transform
        map_fn, map_topic = (None, "") if self._mapped is None or self._tracing else self._mapped
        next_check = checkpoint.next_check
        batch = Batch()
        flat, offsets = batch.outputs, batch.offsets
        handled = dead_lettered = 0
        # consume() hands records out in runs of one partition. Per run, not per record: the key tuple (one
        # object fewer per record for the garbage collector to count, see Batch), whether the partition is
        # ours, and its position, kept in `expected` and written back to `positions` and the batch's
        # `offsets` when the run ends or the batch is handed over (four dict operations fewer a record).
        key: TopicPartitionKey = ("", -1)
        last_topic: str | None = None
        last_partition: int | None = None
        mine = False
        expected = -1  # the run's next offset to process; -1 while nothing is known
        moved = False  # a record of this run was handled since `expected` was last written back
        for msg in msgs:
            error = msg.error()
            if error is not None:
                self._consumer_error(error)
                continue
            # A consumed record always has topic, partition and offset (cast() would cost a call each).
            topic, partition = msg.topic(), msg.partition()
            if partition != last_partition or topic != last_topic:
                if moved:
                    positions[key] = offsets[key] = expected
                    moved = False
                key, last_topic, last_partition = (topic, partition), topic, partition  # type: ignore[assignment]
                mine = key in owned
                expected = positions.get(key, -1)
            if not mine:
                continue  # fetched before its partition was revoked
            offset: int = msg.offset()  # type: ignore[assignment]
            if offset < expected:
                continue  # fetched before a rewind, or processed already
            parked = refused.pop((key[0], key[1], offset), None) if refused else None
            outputs: Outputs
            if parked is not None:
                outputs, dead = [failures.dead_letter(msg, *parked)], True
            elif map_fn is not None:
                # A MapValues: its output's fields go into the batch here, with the rk-id an OutputRecord
                # without headers would get, and no OutputRecord is made. Only a failure takes the general
                # path below (its retry returns OutputRecords).
                try:
                    value = map_fn(msg)
                    outputs, dead = (), False
                except Exception as first:
                    outputs, dead = failures.after_failure(msg, first)
                else:
                    if value is not None:
                        flat.extend((map_topic, value, msg.key(), -1, input_id(msg, key, offset) + b":0", key,
                                     offset, False))
            else:
                try:
                    outputs = transform(msg)  # type: ignore[assignment]  # made a Sequence just below
                    if outputs.__class__ is not list and outputs.__class__ is not tuple:
                        outputs = list(outputs)  # a generator, say: run it now, inside the try
                    for out in outputs:
                        if out.__class__ is not OutputRecord:
                            check_output(out)
                    dead = False
                except Exception as first:
                    outputs, dead = failures.after_failure(msg, first)
            expected, moved = offset + 1, True
            # Each output gets its rk-id now, while the input is at hand: "<input rk-id>:<index>".
            base: bytes | None = None
            index = 0
            headers: OutHeaders
            for out in outputs:
                given = out.headers
                if given is None:
                    if base is None:
                        base = input_id(msg, key, offset)
                    headers = b"%s:%d" % (base, index)  # the rk-id alone: the header list is made at produce()
                else:
                    if given.__class__ is not list:
                        given = header_list(given)
                    only = given[0] if len(given) == 1 else None
                    if only is not None and only[0] == ID_HEADER and only[1].__class__ is bytes:
                        # The rk-id alone (a copy of an input from ReliableProducer, say) is kept as its
                        # value, like an output without headers: no tuples per record held for the
                        # collector to count.
                        headers = only[1]
                    elif has_id(given):  # the caller's id is kept
                        headers = tuple(given)
                    else:
                        base = base or input_id(msg, key, offset)
                        headers = (*given, (ID_HEADER, b"%s:%d" % (base, index)))
                # A records.Out's fields, positionally: topic, value, key, partition, headers, input, offset,
                # dead. extend() with a tuple: the tuple dies at once, so nothing tracked outlives the record.
                flat.extend((out.topic, out.value, out.key, -1 if out.partition is None else out.partition,
                             headers, key, offset, dead))
                index += 1  # noqa: SIM113 - enumerate() would cost a tuple per output
            handled += 1
            if dead:
                dead_lettered += 1
            if now() >= next_check:
                positions[key] = offsets[key] = expected
                moved = False
                batch.messages, batch.dead = handled, dead_lettered
                if checkpoint.add(batch) is Outcome.REWOUND:
                    return Outcome.REWOUND  # the rest of the records at hand are stale
                next_check = checkpoint.next_check
                batch = Batch()
                flat, offsets = batch.outputs, batch.offsets
                handled = dead_lettered = 0
        if moved:
            positions[key] = offsets[key] = expected
        batch.messages, batch.dead = handled, dead_lettered
        return checkpoint.add(batch)

    def _transform_traced(self, msg: Message) -> Outputs:
        """transform() inside a `process` span linked to the input's producer; its outputs carry the
        span's context (replacing a trace context copied from the input), so their consumers link to it."""
        with telemetry.process_span(msg, self._group_id):
            outputs = list(self._transform(msg))
            carrier = telemetry.context_headers()
        if not carrier:
            return outputs
        traced: list[OutputRecord] = []
        for out in outputs:
            if out.__class__ is not OutputRecord:
                check_output(out)
            kept = [(k, v) for k, v in header_list(out.headers) if k not in telemetry.CONTEXT_HEADERS]
            traced.append(replace(out, headers=[*kept, *carrier]))
        return traced

    def _consumer_error(self, error: KafkaError) -> None:
        if error.fatal():
            raise self._checkpoint.stop_with(Failure("consume", TxnStep.STOP, KafkaException(error)))
        log.warning("consumer error: %s", kafka_errors.describe(error))

    # ---- rebalances --------------------------------------------------------------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # New partitions start at their committed offsets, fetched as stable offsets (KIP-447).
        self._checkpoint.owned.update((tp.topic, tp.partition) for tp in partitions)
        log.info("%s assigned %s", self._transactional_id, _names(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info("%s revoked %s", self._transactional_id, _names(partitions))
        if not self._closed:
            # Commit before the partitions are released: the offsets go in under the generation that
            # still owns them, and the next owner starts exactly after what we processed.
            self._checkpoint.settle("partitions revoked")
        self._forget(partitions)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.warning("%s lost %s", self._transactional_id, _names(partitions))
        self._forget(partitions)
        if self._closed or self._checkpoint.broken is not None:
            return
        # Someone else may own them already: their offsets must not be committed by us. The open
        # transaction and the backlog go, and the partitions still owned are rewound and done again.
        self._checkpoint.drop("partitions lost")

    def _forget(self, partitions: list[TopicPartition]) -> None:
        gone = {(tp.topic, tp.partition) for tp in partitions}
        self._checkpoint.forget(gone)
        if self._failures.refused:
            self._failures.forget(gone)


def _group_of(config: Mapping[str, Any], consumer_overrides: Mapping[str, Any] | None, group_id: str | None) -> str:
    """The consumer group: `group.id` in the config, as for ReliableConsumer, or the deprecated `group_id=`."""
    given = config.get("group.id", (consumer_overrides or {}).get("group.id"))
    if group_id is None:
        if not given:
            raise ConfigError("group.id", "is required: put the consumer group's name in the config")
        return str(given)
    if given is not None and given != group_id:
        raise ConfigError("group.id", f"is {given!r} in the config but group_id={group_id!r}: pass group.id only")
    warnings.warn(
        f"TransactionalProcessor(config, group_id={group_id!r}, ...) is deprecated and will be removed in the "
        f"next release: pass TransactionalProcessor({{..., 'group.id': {group_id!r}}}, ...) instead",
        DeprecationWarning, stacklevel=3,
    )
    return group_id


def _names(partitions: list[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing"
