"""The benchmarks behind `reliable-kafka bench`: each variant against its baseline, same run, same brokers.

producer: ReliableProducer.send_many() in memory/process/fsync mode vs raw confluent-kafka: raw_safe (our settings,
          an rk-id header and a callback per message: the targets' baseline) and the bare loop (raw).
producer-calls: one send() per message from 16 / 1 threads and 200 asyncio tasks, each against raw
          confluent-kafka driven the same way (the variants and their drivers: reliable_kafka.bench.calls).
consumer: raw poll loop with auto-commit vs ReliableConsumer (per-partition manual commits), and
          aio.AIOConsumer in a loop with manual commits vs AsyncReliableConsumer (with the worst loop stall).
dedup:    ReliableConsumer with SQLiteDedupStore / RedisDedupStore, each against a hand-written idempotent
          consumer on the same store, and both against ReliableConsumer without dedup.
eos and spark come from reliable_kafka.bench.eos / reliable_kafka.bench.spark.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from reliable_kafka.bench import calls
from reliable_kafka.bench.common import BenchRow, Connection, loop_stalls, round_order, rows_against, run_variant

CreateTopic = Callable[[str, int], None]
Progress = Callable[[str], None]


def _topic(kind: str) -> str:
    return f"bench-{kind}-{uuid.uuid4().hex[:6]}"


def _args(topic: str, n: int, *extra: str) -> list[str]:
    return ["--topic", topic, "--messages", str(n), *extra]


def _interleaved(bench: str, variants: tuple[str, ...], args: Callable[[], list[str]], connection: Connection,
                 repeat: int, progress: Progress) -> dict[str, list[dict[str, Any]]]:
    """Every variant's `repeat` runs, the variants taking turns (A B C, C B A, ...: common.round_order).

    Taking turns, rather than A A B B, spreads a slow or fast minute of the brokers over every variant
    instead of handing it to one of them.
    """
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for round_ in range(repeat):
        for variant in round_order(variants, round_):
            progress(f"{bench}/{variant}" + (f" ({round_ + 1}/{repeat})" if repeat > 1 else ""))
            runs[variant].append(run_variant(bench, variant, args(), connection))
    return runs


def producer_bench(connection: Connection, create_topic: CreateTopic, messages: int, progress: Progress,
                   repeat: int = 1) -> list[BenchRow]:
    def fresh_topic() -> list[str]:
        topic = _topic("producer")
        create_topic(topic, 3)
        return _args(topic, messages)

    # Brokers just started run their first traffic cold (JIT, page cache): an unmeasured run first,
    # or whichever variant goes first is measured against cold brokers and the ratios flatter the rest.
    progress("producer: warming the brokers up")
    run_variant("producer", "raw", fresh_topic(), connection)
    results = _interleaved("producer", PRODUCERS, fresh_topic, connection, repeat, progress)
    # Every variant against raw_safe (the targets' baseline) and, for continuity, against the bare loop.
    return (rows_against("producer", "raw_safe", results, messages)
            + [r for r in rows_against("producer", "raw", results, messages) if r.variant != "raw_safe"])


def producer_calls_bench(connection: Connection, create_topic: CreateTopic, messages: int, progress: Progress,
                         repeat: int = 1) -> list[BenchRow]:
    """How applications send: one send() per message from many threads or tasks, every variant and its
    baseline in the same interleaved rounds."""
    def fresh_topic() -> list[str]:
        topic = _topic("calls")
        create_topic(topic, 3)
        return _args(topic, messages)

    progress(f"{calls.BENCH}: warming the brokers up")
    run_variant(calls.BENCH, calls.VARIANTS[0].name, fresh_topic(), connection)
    results = _interleaved(calls.BENCH, tuple(v.name for v in calls.VARIANTS), fresh_topic, connection, repeat,
                           progress)
    return calls.rows(results, messages)


# The producer bench's variants in the order of its odd rounds (even rounds reverse it: common.round_order).
# raw: the bare loop (no header, one shared callback), the baseline of earlier releases; raw_safe: the same
# loop with what a careful user adds per message (an rk-id header, a callback of its own) and our producer
# settings, the like-for-like baseline of the targets.
PRODUCERS = ("raw", "raw_safe", "memory", "process", "fsync")

# The consumer bench's variants in the order of its odd rounds, each group measured against its first.
SYNC_CONSUMERS = ("raw", "reliable_consumer", "raw_librdkafka_defaults")
AIO_CONSUMERS = ("aio_raw", "aio_reliable")


def consumer_bench(connection: Connection, create_topic: CreateTopic, messages: int, progress: Progress,
                   repeat: int = 1) -> list[BenchRow]:
    topic = _topic("consumer")
    create_topic(topic, 3)
    progress("consumer: filling the topic")
    run_variant("producer", "fill", _args(topic, messages), connection)
    progress("consumer: warming the brokers' fetch path up")
    run_variant("consumer", "raw", _args(topic, messages), connection)
    # raw_librdkafka_defaults: the same loop at librdkafka's fetch defaults, for reference (no target).
    # aio_raw / aio_reliable: the asyncio pair, each run watched by an event-loop stall probe.
    results = _interleaved("consumer", (*SYNC_CONSUMERS, *AIO_CONSUMERS), lambda: _args(topic, messages),
                           connection, repeat, progress)
    rows = rows_against("consumer", "raw", {v: results[v] for v in SYNC_CONSUMERS}, messages)
    aio = {v: results[v] for v in AIO_CONSUMERS}
    return rows + [replace(row, extra=loop_stalls(aio[row.variant]))
                   for row in rows_against("consumer", "aio_raw", aio, messages)]


# The dedup bench's stores, each measured against the idempotent consumer a user writes by hand on the same
# store (bench/worker.py: handwritten_*), and in the order of its odd rounds: `none` (ReliableConsumer without
# dedup, the baseline of the earlier rows, kept for continuity), then each hand-written baseline right before
# the store it judges (right after it in even rounds, which reverse the order), so the two runs of a pair are
# back to back in every round.
DEDUP_BASELINES = {"sqlite": "handwritten_sqlite", "redis": "handwritten_redis"}
DEDUP_VARIANTS = ("none", *(v for store, baseline in DEDUP_BASELINES.items() for v in (baseline, store)))


def dedup_rows(results: dict[str, list[dict[str, Any]]], messages: int) -> list[BenchRow]:
    """Every store against ReliableConsumer without dedup (what dedup costs), then against its hand-written
    baseline (what our claim/confirm costs over writing dedup by hand; the target is on these rows)."""
    rows = rows_against("dedup", "none", {v: results[v] for v in ("none", *DEDUP_BASELINES)}, messages)
    for store, baseline in DEDUP_BASELINES.items():
        rows += rows_against("dedup", baseline, {baseline: results[baseline], store: results[store]}, messages)
    return rows


def dedup_bench(connection: Connection, create_topic: CreateTopic, messages: int, progress: Progress,
                repeat: int = 1, redis_url: str | None = None) -> list[BenchRow]:
    from reliable_kafka.testing.redis_server import RedisServer

    topic = _topic("dedup")
    create_topic(topic, 3)
    progress("dedup: filling the topic")
    run_variant("producer", "fill", _args(topic, messages), connection)
    server = None
    if redis_url is None:
        server = RedisServer()
        server.start()
        redis_url = server.url
    try:
        args = _args(topic, messages, "--redis-url", redis_url)
        progress("dedup: warming the brokers' fetch path up")
        run_variant("dedup", "none", args, connection)
        results = _interleaved("dedup", DEDUP_VARIANTS, lambda: args, connection, repeat, progress)
    finally:
        if server is not None:
            server.stop()
    return dedup_rows(results, messages)
