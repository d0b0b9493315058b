"""The benchmarks behind `reliable-kafka bench`: each variant against its baseline, same run, same brokers.

producer: raw confluent-kafka (acks=all + idempotence) vs ReliableProducer in memory/process/fsync mode.
consumer: raw poll loop with auto-commit vs ReliableConsumer (per-partition manual commits).
dedup:    ReliableConsumer without dedup vs with SQLiteDedupStore vs with RedisDedupStore.
eos and spark come from reliable_kafka.bench.eos / reliable_kafka.bench.spark.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from reliable_kafka.bench.common import BenchRow, rows_against, run_variant

CreateTopic = Callable[[str, int], None]
Progress = Callable[[str], None]


def _topic(kind: str) -> str:
    return f"bench-{kind}-{uuid.uuid4().hex[:6]}"


def _args(bootstrap: str, topic: str, n: int, *extra: str) -> list[str]:
    return ["--bootstrap", bootstrap, "--topic", topic, "--messages", str(n), *extra]


def _best(bench: str, variant: str, args: list[str], repeat: int) -> dict[str, Any]:
    runs = [run_variant(bench, variant, args) for _ in range(repeat)]
    return max(runs, key=lambda r: r["msgs_per_s"])


def producer_bench(bootstrap: str, create_topic: CreateTopic, messages: int, progress: Progress,
                   repeat: int = 1) -> list[BenchRow]:
    results: dict[str, dict[str, Any]] = {}
    for variant in ("raw", "memory", "process", "fsync"):
        progress(f"producer/{variant}")
        runs = []
        for _ in range(repeat):
            topic = _topic("producer")
            create_topic(topic, 3)
            runs.append(run_variant("producer", variant, _args(bootstrap, topic, messages)))
        results[variant] = max(runs, key=lambda r: r["msgs_per_s"])
    return rows_against("producer", "raw", results, messages)


def consumer_bench(bootstrap: str, create_topic: CreateTopic, messages: int, progress: Progress,
                   repeat: int = 1) -> list[BenchRow]:
    topic = _topic("consumer")
    create_topic(topic, 3)
    progress("consumer: filling the topic")
    run_variant("producer", "fill", _args(bootstrap, topic, messages))
    results = {}
    for variant in ("raw", "reliable_consumer"):
        progress(f"consumer/{variant}")
        results[variant] = _best("consumer", variant, _args(bootstrap, topic, messages), repeat)
    return rows_against("consumer", "raw", results, messages)


def dedup_bench(bootstrap: str, create_topic: CreateTopic, messages: int, progress: Progress,
                repeat: int = 1, redis_url: str | None = None) -> list[BenchRow]:
    from reliable_kafka.testing.redis_server import RedisServer

    topic = _topic("dedup")
    create_topic(topic, 3)
    progress("dedup: filling the topic")
    run_variant("producer", "fill", _args(bootstrap, topic, messages))
    server = None
    if redis_url is None:
        server = RedisServer()
        server.start()
        redis_url = server.url
    try:
        results = {}
        for variant in ("none", "sqlite", "redis"):
            progress(f"dedup/{variant}")
            results[variant] = _best("dedup", variant,
                                     _args(bootstrap, topic, messages, "--redis-url", redis_url), repeat)
    finally:
        if server is not None:
            server.stop()
    return rows_against("dedup", "none", results, messages)
