"""One benchmark variant in a process of its own; prints {"msgs_per_s", "peak_rss_mb", ...} as JSON.

Each variant runs alone so that its CPU time and peak RSS are not mixed with another variant's.
The clock runs from the first message to the last confirmation (delivery report or handled record).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sqlite3
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.bench import calls
from reliable_kafka.bench.common import peak_rss_mb
from reliable_kafka.config import producer_config
from reliable_kafka.ids import ID_HEADER, message_id_of, new_id, new_ids
from reliable_kafka.producer_id import prime_producer_id
from reliable_kafka.testing.child_connection import Connection, connection_from_env
from reliable_kafka.testing.loop_stall import LoopStallProbe

VALUE = b"x" * 100
BATCH = 1_000


def produce_raw(connection: Connection, topic: str, n: int, with_ids: bool = False) -> float:
    """Baseline: bare confluent-kafka with acks=all + idempotence, the usual poll(0) loop.

    `with_ids` adds an rk-id header (filling a topic for the dedup benchmark).
    """
    p = Producer({**connection, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    prime_producer_id(p)  # as ReliableProducer's poller does: no variant's clock holds the 0.5 s id wait
    delivered = [0]

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is None:
            delivered[0] += 1

    ids = new_ids(n) if with_ids else None
    start = time.perf_counter()
    for i in range(n):
        headers: list[tuple[str, str | bytes | None]] | None = (
            [(ID_HEADER, ids[i].encode())] if ids is not None else None
        )
        # Keywords, as a plain confluent-kafka program writes it: this is the baseline.
        produce_when_room(p, topic, VALUE, on_delivery=on_delivery, headers=headers, poll_s=0.01)
        p.poll(0)
    p.flush(300)
    took = time.perf_counter() - start
    assert delivered[0] == n, f"raw producer delivered {delivered[0]} of {n}"
    return took


def produce_raw_safe(connection: Connection, topic: str, n: int) -> float:
    """The producer bench's like-for-like baseline: what a careful user hand-writes with bare confluent-kafka.

    Our producer settings (producer_config(): acks=all + idempotence and the same batching), and per message
    what ReliableProducer gives every message: an rk-id header (the same id function) and a delivery
    callback of its own that knows which message it reports, so a failure can be told apart and sent
    again. The same poll(0) loop as `raw`; keywords, as a program writes it.
    """
    p = Producer(producer_config(connection))
    prime_producer_id(p)  # as ReliableProducer's poller does (producer_id.py)
    delivered = [0]
    failed: dict[str, str] = {}  # message id -> reason: what a careful program keeps to send again

    def on_delivery(message_id: str, err: Any, _msg: Any) -> None:
        if err is None:
            delivered[0] += 1
        else:
            failed[message_id] = str(err)

    start = time.perf_counter()
    for _ in range(n):
        message_id = new_id()
        produce_when_room(p, topic, VALUE, headers=[(ID_HEADER, message_id.encode())],
                          on_delivery=functools.partial(on_delivery, message_id), poll_s=0.01)
        p.poll(0)
    p.flush(300)
    took = time.perf_counter() - start
    assert delivered[0] == n and not failed, f"raw_safe delivered {delivered[0]} of {n}, failed {len(failed)}"
    return took


def produce_reliable(connection: Connection, topic: str, n: int, durability: str) -> float:
    from reliable_kafka.producer import ReliableProducer

    with tempfile.TemporaryDirectory() as d:
        kw: dict[str, Any] = {} if durability == "memory" else {"outbox_path": os.path.join(d, "bench.db")}
        p = ReliableProducer(dict(connection), durability=durability, **kw)
        p.check_topics([topic])
        batch = [(topic, VALUE)] * BATCH
        start = time.perf_counter()
        for i in range(0, n, BATCH):
            p.send_many(batch[: min(BATCH, n - i)])
        left = p.flush(300)
        took = time.perf_counter() - start
        p.close()
        assert left == 0, f"{left} messages undelivered"
    return took


class _Counting:
    """The application's handler in every consumer variant: count the record, note the first one's time.

    Both the baseline loop and ReliableConsumer call it once per record, so a ratio measures what the
    consumer adds around the application's work, not the work itself.
    """

    def __init__(self, n: int, on_last: Callable[[], None] = lambda: None) -> None:
        self.n, self.handled, self.first, self._on_last = n, 0, 0.0, on_last

    def __call__(self, _msg: Any) -> None:
        if not self.handled:
            self.first = time.perf_counter()
        self.handled += 1
        if self.handled >= self.n:
            self._on_last()


def consume_raw(connection: Connection, topic: str, n: int, fetch_like_ours: bool = True) -> float:
    """Baseline: bare confluent-kafka poll loop with auto-commit, the same handler per record.

    `fetch_like_ours`: the same fetch.queue.backoff.ms as ReliableConsumer's defaults, so that the
    ratio measures what the consumer adds, not a fetch setting (at librdkafka's default of 1 s the
    fetch stalls, not the client, set the pace: see the `raw_librdkafka_defaults` variant).
    """
    from reliable_kafka.config import CONSUMER_DEFAULTS

    fetch = {"fetch.queue.backoff.ms": CONSUMER_DEFAULTS["fetch.queue.backoff.ms"]} if fetch_like_ours else {}
    c = Consumer({**connection, "group.id": f"bench-raw-{time.time_ns()}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": True, **fetch})
    c.subscribe([topic])
    handler = _Counting(n)
    while handler.handled < n:
        for m in c.consume(num_messages=500, timeout=1.0):
            if m.error() is None:
                handler(m)
    took = time.perf_counter() - handler.first
    c.close()
    return took


def _awaited(counting: _Counting) -> Callable[[Any], Awaitable[None]]:
    """The asyncio variants' handler: an `async def` doing what _Counting does, so the sync and the asyncio
    pairs measure the same work per record."""

    async def handle(msg: Any) -> None:
        counting(msg)

    return handle


async def consume_aio_raw(connection: Connection, topic: str, n: int) -> tuple[float, dict[str, Any]]:
    """Baseline for AsyncReliableConsumer: confluent-kafka's own asyncio consumer (aio.AIOConsumer), as a careful
    user writes it: the raw loop's group settings without auto-commit, `await consume(500, 1.0)`, the async
    handler awaited per record, then the batch's offsets committed before the next batch is fetched.

    The commit names its offsets (per partition, the last handled record's offset + 1) rather than committing
    the consumer's positions: with the default enable.auto.offset.store, consume() stores offsets as soon as
    it returns a batch, not once it is handled, so only explicit offsets say "handled". It is synchronous
    (asynchronous=False): AIOConsumer runs commit() on its executor's thread, so waiting for the broker
    does not block the loop, and the await returning means the batch is committed (an asynchronous commit's
    outcome would only reach an on_commit callback, served by a later consume()).
    """
    from confluent_kafka import TopicPartition
    from confluent_kafka.aio import AIOConsumer

    from reliable_kafka.config import CONSUMER_DEFAULTS

    c = AIOConsumer({**connection, "group.id": f"bench-aio-raw-{time.time_ns()}",
                     "auto.offset.reset": "earliest", "enable.auto.commit": False,
                     "fetch.queue.backoff.ms": CONSUMER_DEFAULTS["fetch.queue.backoff.ms"]})
    counting = _Counting(n)
    handler = _awaited(counting)
    try:
        with LoopStallProbe(calls.PROBE_S) as probe:
            await c.subscribe([topic])
            while counting.handled < n:
                ends: dict[tuple[str, int], int] = {}
                for m in await c.consume(num_messages=500, timeout=1.0):
                    if m.error() is None:
                        await handler(m)
                        ends[(m.topic(), m.partition())] = m.offset() + 1
                if ends:
                    committed = await c.commit(offsets=[TopicPartition(t, p, o) for (t, p), o in ends.items()],
                                               asynchronous=False)
                    failed = [tp for tp in committed or () if tp.error is not None]
                    if failed:
                        raise RuntimeError(f"AIOConsumer: commit failed for {failed}")
            took = time.perf_counter() - counting.first
    finally:
        await c.close()
    return took, probe.facts()


async def consume_aio_reliable(connection: Connection, topic: str, n: int) -> tuple[float, dict[str, Any]]:
    """Ours: AsyncReliableConsumer.run() with the same async handler, stopped by it after `n` records; the
    clock stops when run() returned (what was handled is committed then)."""
    from reliable_kafka.consumer.aio import AsyncReliableConsumer

    consumer = AsyncReliableConsumer({**connection, "group.id": f"bench-aio-rk-{time.time_ns()}"},
                                     [topic])
    counting = _Counting(n, consumer.stop)
    try:
        with LoopStallProbe(calls.PROBE_S) as probe:
            await consumer.run(_awaited(counting))
            took = time.perf_counter() - counting.first
    finally:
        await consumer.close()
    if counting.handled < n:
        raise RuntimeError(f"AsyncReliableConsumer: run() returned after {counting.handled} of {n} records")
    return took, probe.facts()


# The hand-written dedup consumer's step for one poll batch: record the batch's keys in ONE store transaction,
# run the handler for the records whose key was new, and return once the keys are stored.
DedupBatch = Callable[[list[Message], Callable[[Message], None]], None]


def consume_handwritten(connection: Connection, topic: str, n: int, dedup_batch: DedupBatch) -> float:
    """Baseline for ReliableConsumer with a dedup store: the idempotent consumer a careful user writes by hand.

    The raw loop's fetch settings, `consume(500)` batches, each batch's keys stored by `dedup_batch` before
    any of its offsets is committed (a crash in between redelivers records whose keys are stored: skipped,
    never lost). Offsets are committed as ReliableConsumer commits them, so that the ratio measures the
    dedup, not a commit cadence: named (per partition, the last stored record's offset + 1; with auto-commit
    off only those say "handled"), asynchronously once per CommitPolicy interval (committing every batch
    instead cost this loop 25-50 % of its throughput in a 200k-record probe here, the brokers sharing its two
    cores), and all of them synchronously at the end, as stop() does; the clock stops when that returned.
    """
    from reliable_kafka.config import CONSUMER_DEFAULTS
    from reliable_kafka.consumer import CommitPolicy

    every_s = CommitPolicy().interval_s
    c = Consumer({**connection, "group.id": f"bench-hand-{time.time_ns()}", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False,
                  "fetch.queue.backoff.ms": CONSUMER_DEFAULTS["fetch.queue.backoff.ms"]})
    c.subscribe([topic])
    handler = _Counting(n)
    seen = 0
    ends: dict[tuple[str, int], int] = {}
    last_commit = time.monotonic()
    try:
        while seen < n:
            batch = [m for m in c.consume(num_messages=500, timeout=1.0) if m.error() is None]
            if not batch:
                continue
            dedup_batch(batch, handler)
            seen += len(batch)
            ends.update(_next_offsets(batch))
            if seen < n and time.monotonic() - last_commit >= every_s:
                c.commit(offsets=_partitions(ends), asynchronous=True)
                last_commit = time.monotonic()
        failed = [tp for tp in c.commit(offsets=_partitions(ends), asynchronous=False) if tp.error is not None]
        if failed:
            raise RuntimeError(f"hand-written dedup consumer: final commit failed for {failed}")
        took = time.perf_counter() - handler.first
    finally:
        c.close()
    if handler.handled != n:
        # Every record of the filled topic has its own rk-id: a skipped one means the store or the topic is wrong.
        raise RuntimeError(f"hand-written dedup consumer handled {handler.handled} of {n} records")
    return took


def _next_offsets(batch: list[Message]) -> dict[tuple[str, int], int]:
    """Per partition of the batch, the offset after its last record: what committing the batch names."""
    return {(m.topic(), m.partition()): m.offset() + 1 for m in batch}  # type: ignore[misc,operator]


def _partitions(offsets: dict[tuple[str, int], int]) -> list[TopicPartition]:
    return [TopicPartition(t, p, o) for (t, p), o in offsets.items()]


def sqlite_batches(path: str) -> DedupBatch:
    """One `INSERT OR IGNORE` per record in one transaction per batch, the handler inside it for the records
    whose insert added a row: a handler that raises rolls its batch's keys back. WAL with synchronous=NORMAL,
    as SQLiteDedupStore."""
    conn = sqlite3.connect(path)  # Python's implicit BEGIN before the first INSERT, COMMIT by `with conn`
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE IF NOT EXISTS processed (key TEXT PRIMARY KEY)")

    def record(batch: list[Message], handler: Callable[[Message], None]) -> None:
        with conn:
            for m in batch:
                added = conn.execute("INSERT OR IGNORE INTO processed (key) VALUES (?)",
                                     (message_id_of(m.headers()),)).rowcount  # type: ignore[arg-type]
                if added:
                    handler(m)

    return record


def redis_batches(url: str, prefix: str) -> DedupBatch:
    """One `SET key 1 NX EX <ttl>` per record, pipelined, one round trip per batch (no MULTI: each SET stands
    alone), then the handler for the records whose SET took; the TTL is RedisDedupStore's default retention.

    The key is stored before the handler runs, as hand-written Redis dedup usually is: a handler that fails
    leaves its key set, and the redelivered record is skipped (the claim/confirm stores exist to avoid that).
    """
    import redis

    from reliable_kafka.dedup.base import DEFAULT_RETENTION_S

    client = redis.Redis.from_url(url)

    def record(batch: list[Message], handler: Callable[[Message], None]) -> None:
        pipe = client.pipeline(transaction=False)
        for m in batch:
            pipe.set(f"{prefix}{message_id_of(m.headers())}", 1, nx=True,  # type: ignore[arg-type]
                     ex=DEFAULT_RETENTION_S)
        for m, took in zip(batch, pipe.execute(), strict=True):
            if took:
                handler(m)

    return record


def consume_handwritten_sqlite(connection: Connection, topic: str, n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        return consume_handwritten(connection, topic, n, sqlite_batches(os.path.join(d, "dedup.db")))


def consume_handwritten_redis(connection: Connection, topic: str, n: int, redis_url: str | None) -> float:
    assert redis_url, "the handwritten_redis variant needs --redis-url"
    return consume_handwritten(connection, topic, n, redis_batches(redis_url, f"bench:{time.time_ns()}:"))


def consume_reliable(connection: Connection, topic: str, n: int, dedup: str | None, redis_url: str | None) -> float:
    from reliable_kafka.consumer import DedupPolicy, ReliableConsumer

    store: Any = None
    tmp = tempfile.TemporaryDirectory()
    if dedup == "sqlite":
        from reliable_kafka.dedup import SQLiteDedupStore

        store = SQLiteDedupStore(os.path.join(tmp.name, "dedup.db"))
    elif dedup == "redis":
        from reliable_kafka.dedup.redis import RedisDedupStore

        assert redis_url, "the redis variant needs --redis-url"
        store = RedisDedupStore(redis_url, prefix=f"bench:{time.time_ns()}:")
    consumer = ReliableConsumer({**connection, "group.id": f"bench-rk-{time.time_ns()}"},
                                [topic], dedup=DedupPolicy(store) if store is not None else None)
    handler = _Counting(n, consumer.stop)
    consumer.run(handler)
    took = time.perf_counter() - handler.first
    consumer.close()
    if store is not None:
        store.close()
    tmp.cleanup()
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("variant")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--messages", type=int, required=True)
    ap.add_argument("--redis-url")
    a = ap.parse_args()
    conn = connection_from_env()
    # A variant returns its seconds, or (seconds, facts for its JSON) (producer-calls, the asyncio consumers).
    runs: dict[tuple[str, str], Callable[[], float | tuple[float, dict[str, Any]]]] = {
        ("producer", "raw"): lambda: produce_raw(conn, a.topic, a.messages),
        ("producer", "raw_safe"): lambda: produce_raw_safe(conn, a.topic, a.messages),
        ("producer", "fill"): lambda: produce_raw(conn, a.topic, a.messages, with_ids=True),
        ("consumer", "raw"): lambda: consume_raw(conn, a.topic, a.messages),
        ("consumer", "raw_librdkafka_defaults"): lambda: consume_raw(conn, a.topic, a.messages, False),
        ("consumer", "reliable_consumer"): lambda: consume_reliable(conn, a.topic, a.messages, None, None),
        ("consumer", "aio_raw"): lambda: asyncio.run(consume_aio_raw(conn, a.topic, a.messages)),
        ("consumer", "aio_reliable"): lambda: asyncio.run(consume_aio_reliable(conn, a.topic, a.messages)),
        ("dedup", "none"): lambda: consume_reliable(conn, a.topic, a.messages, None, None),
        ("dedup", "sqlite"): lambda: consume_reliable(conn, a.topic, a.messages, "sqlite", None),
        ("dedup", "redis"): lambda: consume_reliable(conn, a.topic, a.messages, "redis", a.redis_url),
        ("dedup", "handwritten_sqlite"): lambda: consume_handwritten_sqlite(conn, a.topic, a.messages),
        ("dedup", "handwritten_redis"): lambda: consume_handwritten_redis(conn, a.topic, a.messages, a.redis_url),
    }
    for durability in ("memory", "process", "fsync"):
        runs[("producer", durability)] = functools.partial(produce_reliable, conn, a.topic, a.messages,
                                                           durability)
    for variant in calls.VARIANTS:
        runs[(calls.BENCH, variant.name)] = functools.partial(calls.run, variant, conn, a.topic, a.messages)
    rss_before = peak_rss_mb()
    outcome = runs[(a.bench, a.variant)]()
    took, facts = outcome if isinstance(outcome, tuple) else (outcome, {})
    print(json.dumps({"msgs_per_s": a.messages / took, "seconds": took, "peak_rss_mb": peak_rss_mb(),
                      "rss_before_mb": rss_before, **facts}))
    # A lingering librdkafka thread must not keep the benchmark waiting.
    threading.Event().wait(0.1)
    os._exit(0)


if __name__ == "__main__":
    main()
