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
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from confluent_kafka import Consumer, Producer

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.bench import calls
from reliable_kafka.bench.common import peak_rss_mb
from reliable_kafka.ids import ID_HEADER, new_ids
from reliable_kafka.testing.child_connection import Connection, connection_from_env
from reliable_kafka.testing.loop_stall import LoopStallProbe

VALUE = b"x" * 100
BATCH = 1_000


def produce_raw(connection: Connection, topic: str, n: int, with_ids: bool = False) -> float:
    """Baseline: bare confluent-kafka with acks=all + idempotence, the usual poll(0) loop.

    `with_ids` adds an rk-id header (filling a topic for the dedup benchmark).
    """
    p = Producer({**connection, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
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
        ("producer", "fill"): lambda: produce_raw(conn, a.topic, a.messages, with_ids=True),
        ("consumer", "raw"): lambda: consume_raw(conn, a.topic, a.messages),
        ("consumer", "raw_librdkafka_defaults"): lambda: consume_raw(conn, a.topic, a.messages, False),
        ("consumer", "reliable_consumer"): lambda: consume_reliable(conn, a.topic, a.messages, None, None),
        ("consumer", "aio_raw"): lambda: asyncio.run(consume_aio_raw(conn, a.topic, a.messages)),
        ("consumer", "aio_reliable"): lambda: asyncio.run(consume_aio_reliable(conn, a.topic, a.messages)),
        ("dedup", "none"): lambda: consume_reliable(conn, a.topic, a.messages, None, None),
        ("dedup", "sqlite"): lambda: consume_reliable(conn, a.topic, a.messages, "sqlite", None),
        ("dedup", "redis"): lambda: consume_reliable(conn, a.topic, a.messages, "redis", a.redis_url),
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
