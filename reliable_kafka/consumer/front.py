"""ReliableConsumer: commits per partition only what was processed, safe across rebalances.

An offset is committed only when it and every offset before it on that partition were processed
(or parked in the dead-letter topic with an acknowledged write); offsets are committed before a
partition is released, and staged offsets of lost partitions are dropped (failure modes L6, L7).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message

from reliable_kafka import rdkafka_stats, telemetry
from reliable_kafka.config import consumer_config
from reliable_kafka.consumer.commits import CommitCoordinator, CommitPolicy
from reliable_kafka.consumer.decoding import Decoding
from reliable_kafka.consumer.dedup_stage import DedupPolicy, DedupStage, KeyFunction, rk_id_of
from reliable_kafka.consumer.failures import DeadLetters, FailureStages
from reliable_kafka.consumer.fetcher import Fetcher
from reliable_kafka.consumer.lag import partition_lag
from reliable_kafka.consumer.rebalance import RebalanceHandler
from reliable_kafka.consumer.strategies import ClaimedStrategy, RecordStrategy, choose
from reliable_kafka.consumer.work import BatchHandler, Handler
from reliable_kafka.dedup.base import DedupStore
from reliable_kafka.deprecation import warn_deprecated
from reliable_kafka.dlq import DeadLetterPolicy
from reliable_kafka.errors import ClientClosed, ConfigError, DeserializationError, ReliableKafkaError
from reliable_kafka.kafka_errors import describe
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.serdes import UserDeserializer, decoder
from reliable_kafka.stats import Counters, Stats

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("reliable_kafka.rdkafka")

_DEAD_LETTER_TOPIC = DeadLetterPolicy()  # the default: "{topic}.dlq"

# The flat arguments CommitPolicy and DedupPolicy replace: accepted, with a DeprecationWarning, for one release.
_OLD_COMMIT = {"commit_interval_s": "interval_s", "commit_every": "every", "commit_timeout_s": "timeout_s"}
_OLD_DEDUP = {"dedup_key": "key", "dedup_lease_s": "lease_s", "dedup_fail_open": "fail_open"}

# What stats() reports, always all of them (docs/consumer.md#stats says what each counts).
STATS = ("handled", "dead_lettered", "duplicates_skipped", "commits", "commit_failures", "store_outages",
         "store_retries", "left_for_new_owner")


class ReliableConsumer:
    """A consumer group member that never commits past unprocessed work.

    Two ways to use it:
      * handler API: `run(handler)` — retries (RetryPolicy), dead-letter topic, optional bounded
        concurrency (`concurrency=N`, records of one key stay in order), optional batch handler,
        optional dedup (DedupPolicy); stops gracefully on `stop()` (e.g. from a SIGTERM handler).
      * explicit API: `for msg in consumer: ...; consumer.ack(msg)` — you say what was processed.
    Offsets are committed as the CommitPolicy says (every second by default), on revoke and on close.

    It composes parts that each own their state: the fetcher (fetcher.py), the commit coordinator
    (commits.py), the rebalance handler (rebalance.py), the failure stages (failures.py), the dedup
    stage (dedup_stage.py) and, per run(), a processing strategy (strategies.py).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        dead_letter: DeadLetterPolicy | None = _DEAD_LETTER_TOPIC,
        concurrency: int = 1,
        max_in_flight: int = 2_000,
        max_batch: int = 500,
        commit: CommitPolicy | None = None,
        dedup: DedupPolicy | DedupStore | None = None,  # a bare store: deprecated, as are the dedup_* arguments
        revoke_timeout_s: float = 30.0,
        value_deserializer: UserDeserializer | None = None,
        key_deserializer: UserDeserializer | None = None,
        **deprecated: Any,
    ) -> None:
        if not topics:
            raise ConfigError("topics", "subscribe to at least one topic")
        if concurrency < 1:
            raise ConfigError("concurrency", f"must be at least 1, got {concurrency}")
        if max_in_flight < max_batch:
            raise ConfigError("max_in_flight", f"must be at least max_batch ({max_batch})")
        commit, dedup, key_of = _migrate(commit, dedup, deprecated)
        self._config = consumer_config(config)
        self.topics = list(topics)
        self._concurrency = concurrency
        self._revoke_timeout_s = revoke_timeout_s
        self._tracing = telemetry.tracing_enabled()
        self._metrics = telemetry.metrics_enabled()  # per-record measurements only with an SDK installed
        group = self._group = str(self._config["group.id"])
        # Subscribed to one topic by name (not a ^regex): every record's topic is known without asking.
        self._single_topic = self.topics[0] if len(self.topics) == 1 and not self.topics[0].startswith("^") else None
        self._stop = threading.Event()
        self._counters = Counters(STATS)
        self._dedup = DedupStage(dedup, self._counters, group) if dedup is not None else None
        self._key_of = self._dedup.key_of if self._dedup is not None else key_of
        # None without deserializers: then nothing is decoded and no record pays for the check.
        decode_key, decode_value = decoder(key_deserializer, "key"), decoder(value_deserializer, "value")
        self._decoding = Decoding(decode_key, decode_value) if decode_key or decode_value else None

        conf = dict(self._config)
        conf.setdefault("logger", _rdkafka_log)
        conf["error_cb"] = _on_error
        if (stats_cb := rdkafka_stats.collector(conf, "consumer")) is not None:
            conf["stats_cb"] = stats_cb
        user_on_commit = conf.get("on_commit")
        # Served by consume() on the loop thread, so the coordinator exists by the time it is called.
        conf["on_commit"] = lambda err, partitions: self._commits.on_commit(err, partitions)
        self._client = Consumer(conf)

        self._commits: CommitCoordinator = CommitCoordinator(
            self._client, commit, self._counters, group=group, user_on_commit=user_on_commit,
            confirm=self._dedup.confirmed if self._dedup is not None else None,
        )
        self._rebalance = RebalanceHandler(
            self._client, self._commits, revoke_timeout_s=revoke_timeout_s,
            on_assigned=self._dedup.assigned if self._dedup is not None else lambda partitions: None)
        self._fetcher = Fetcher(self._client, self._commits.tracker, self._rebalance, self._dedup,
                                max_batch=max_batch, max_in_flight=max_in_flight, group=group)
        self._dead_letters = DeadLetters(dead_letter, self._config)
        self._failures = FailureStages(retry or RetryPolicy(), self._dead_letters, self._commits, self._dedup,
                                       self._counters, self._stop, tracing=self._tracing, group=group)
        self._rebalance.also_forget(self._fetcher, self._dead_letters)
        if self._dedup is not None:
            self._rebalance.also_forget(self._dedup)
            self._dedup.on_fenced = self._rebalance.fenced
        self._started = False
        self._closed = False

    # ---- lifecycle (docs/api.md#lifecycle: the same rule for every client) ----------------

    def start(self) -> ReliableConsumer:
        """Subscribe (idempotent); `with`, run(), poll() and iteration call it for you."""
        if self._closed:
            raise ClientClosed("this ReliableConsumer was closed; create a new one")
        if not self._started:
            self._started = True
            self._client.subscribe(self.topics, on_assign=self._rebalance.on_assign,
                                   on_revoke=self._rebalance.on_revoke, on_lost=self._rebalance.on_lost)
            telemetry.register_consumer(self, self._group, functools.partial(partition_lag, self._client,
                                                                             self._commits.tracker))
        return self

    # ---- explicit API --------------------------------------------------------------------

    def poll(self, timeout: float = 1.0) -> Message | None:
        """The next record (tracked as in flight until you ack() it), or None.

        With a deserializer its key / value are decoded; one that cannot be decoded raises
        DeserializationError, whose `record` is the Message as consumed (ack() it once you parked it).
        """
        if not self._started:
            self.start()
        for msg in self._fetcher.fetch(1, timeout):
            if self._decoding is not None:
                try:
                    self._decoding.decode(msg)
                except DeserializationError as exc:
                    exc.record = msg
                    raise
            return msg
        return None

    def __iter__(self) -> Iterator[Message]:
        while not self._stop.is_set():
            msg = self.poll(0.5)
            if msg is not None:
                yield msg
            self._commits.maybe_commit()

    def ack(self, msg: Message) -> None:
        """Mark a record processed: its offset may be committed once everything before it is too."""
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        assert topic is not None and partition is not None and offset is not None
        self._commits.ack(topic, partition, offset)

    def maybe_commit(self) -> None:
        """Commit if the CommitPolicy's interval or count since the last commit is reached (asynchronously;
        after a failed commit, synchronously)."""
        self._commits.maybe_commit()

    def commit(self, partitions: Sequence[tuple[str, int]] | None = None) -> dict[tuple[str, int], int]:
        """Synchronously commit what is processed (of `partitions`, or all); returns what was committed."""
        return self._commits.commit(partitions)

    # ---- handler API ---------------------------------------------------------------------

    def run(self, handler: Handler | BatchHandler, *, batch: bool = False, stop_after: float | None = None) -> None:
        """Consume until stop() (or `stop_after` seconds), calling `handler` for each record (or batch).

        A handler that raises is retried by the RetryPolicy; a record that still fails goes to the
        dead-letter topic, and its offset is committed only after that write is acknowledged. With a
        deserializer the handler sees the records decoded; one that cannot be decoded fails like a
        handler (retried, then dead-lettered with its original bytes).
        """
        self.start()
        deadline = None if stop_after is None else time.monotonic() + stop_after
        if self._decoding is not None:  # decided once per run: without deserializers no record pays for it
            handler = (self._decoding.batch_handler(handler) if batch  # type: ignore[arg-type]
                       else self._decoding.handler(handler))  # type: ignore[arg-type]
        if self._metrics:  # likewise: without an SDK no record pays for the timing
            handler = telemetry.timed_handler(handler, self._group, batch=batch)
        strategy = choose(handler, batch=batch, concurrency=self._concurrency, tracing=self._tracing,
                          dedup=self._dedup, single_topic=self._single_topic, fetcher=self._fetcher,
                          failures=self._failures, commits=self._commits, counters=self._counters)
        self._serve(strategy, deadline)

    def _serve(self, strategy: RecordStrategy | ClaimedStrategy, deadline: float | None) -> None:
        """The fetch loop of run(), for any strategy: every front end runs this on the thread that owns
        the client (AsyncReliableConsumer on its own thread, with a strategy that hands records to the
        event loop). Until stop() or `deadline`: fetch, retry stuck dead-letter writes, confirm, commit.
        Then the graceful stop: finish in-flight records (strategy.close, bounded by revoke_timeout_s),
        confirm, commit."""
        saved_wait_idle = self._rebalance.wait_idle
        self._rebalance.wait_idle = strategy.wait_idle
        fetcher, failures, commits = self._fetcher, self._failures, self._commits
        try:
            while not self._stop.is_set() and (deadline is None or time.monotonic() < deadline):
                fetcher.step(strategy)
                failures.retry_stuck()
                commits.confirm_handled()
                commits.maybe_commit()
        finally:
            # Graceful stop: finish in-flight records, confirm, commit.
            strategy.close(self._revoke_timeout_s)
            # Nothing runs records any more: a revoke in close() has nothing to wait for.
            self._rebalance.wait_idle = saved_wait_idle
            try:
                commits.commit()
            except ReliableKafkaError as exc:
                log.error("commit at stop failed (records will be redelivered, not lost): %s", exc)

    def stop(self) -> None:
        """Ask run() to finish: stop fetching, finish in-flight records, commit, return. Signal-safe."""
        self._stop.set()

    def close(self, timeout: float = 30.0) -> None:
        """Commit what is processed and leave the group (revoked partitions are committed first).

        Idempotent: a second call does nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        telemetry.unregister_consumer(self)  # before the client goes: the lag is read from it
        try:
            self._commits.commit()
        except ReliableKafkaError as exc:
            log.error("final commit failed (records will be redelivered, not lost): %s", exc)
        # The partitions go back while this consumer still serves the group: the client's close then finds
        # no revoke left to run (see leave_before_close).
        self._rebalance.leave(self._config, timeout)
        self._client.close()
        self._dead_letters.close(timeout)

    def __enter__(self) -> ReliableConsumer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> Stats:
        """What this consumer did so far: handled, dead_lettered, duplicates_skipped, commits, ...

        An immutable snapshot: `stats().handled` or `stats()["handled"]`; every name is there from the start.
        """
        return self._counters.stats()

    @property
    def counts(self) -> dict[str, int]:
        """Deprecated: stats() has the same counts (as attributes too)."""
        warn_deprecated("ReliableConsumer.counts", "use ReliableConsumer.stats()", stacklevel=2)
        return dict(self.stats())

    @property
    def assignment(self) -> list[tuple[str, int]]:
        return [(tp.topic, tp.partition) for tp in self._client.assignment()]

    def dedup_key_of(self, msg: Message) -> str | None:
        """The key the dedup store claims for `msg`: its rk-id, unless DedupPolicy(key=...) says otherwise.

        A handler whose effect lives in the store (inbox mode) passes it to `store.inbox([key])`, so
        the effect and the confirmation commit together; the consumer's own confirmation after the
        handler then finds the key done and changes nothing.
        """
        return self._key_of(msg)


def _on_error(err: KafkaError) -> None:
    if err.code() == KafkaError._ALL_BROKERS_DOWN:
        log.warning("all brokers are down; nothing is committed until they are back")
    else:
        log.debug("consumer: %s", describe(err))


def _migrate(commit: CommitPolicy | None, dedup: DedupPolicy | DedupStore | None,
             old: dict[str, Any]) -> tuple[CommitPolicy, DedupPolicy | None, KeyFunction]:
    """The policies, from the new arguments or (deprecated) the flat ones; refuses a mix of both.

    Returns the key function too: before DedupPolicy, `dedup_key=` set dedup_key_of() even without a store.
    """
    unknown = sorted(set(old) - set(_OLD_COMMIT) - set(_OLD_DEDUP))
    if unknown:
        raise TypeError(f"ReliableConsumer() got an unexpected keyword argument {unknown[0]!r}")
    old_commit = {_OLD_COMMIT[k]: v for k, v in old.items() if k in _OLD_COMMIT}
    if old_commit:
        if commit is not None:
            raise ConfigError("commit", f"pass CommitPolicy(...) or {_args(_OLD_COMMIT, old, '...')}, not both")
        _warn(_args(_OLD_COMMIT, old, "..."), f"commit=CommitPolicy({_args(old_commit, old_commit, '...')})")
        commit = CommitPolicy(**old_commit)
    old_dedup = {_OLD_DEDUP[k]: v for k, v in old.items() if k in _OLD_DEDUP}
    bare_store = dedup is not None and not isinstance(dedup, DedupPolicy)
    if isinstance(dedup, DedupPolicy) and old_dedup:
        raise ConfigError("dedup", f"pass DedupPolicy(...) or {_args(_OLD_DEDUP, old, '...')}, not both")
    if bare_store or old_dedup:
        what = ", ".join(["dedup=store"] * bare_store + ([_args(_OLD_DEDUP, old, "...")] if old_dedup else []))
        _warn(what, f"dedup=DedupPolicy({', '.join(['store', *(f'{k}=...' for k in old_dedup)])})")
        if bare_store:
            dedup = DedupPolicy(dedup, **old_dedup)  # type: ignore[arg-type]
    if isinstance(dedup, DedupPolicy):
        return commit or CommitPolicy(), dedup, dedup.key or rk_id_of
    return commit or CommitPolicy(), None, old_dedup.get("key") or rk_id_of


def _args(table: Mapping[str, Any], given: Mapping[str, Any], value: str) -> str:
    """The arguments of `table` that were `given`, as "name=value, ..." in the caller's order."""
    return ", ".join(f"{k}={value}" for k in given if k in table)


def _warn(old: str, new: str) -> None:
    warn_deprecated(f"ReliableConsumer({old})", f"pass {new}", stacklevel=4)  # the line calling ReliableConsumer()
