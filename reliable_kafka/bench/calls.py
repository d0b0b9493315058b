"""`reliable-kafka bench producer-calls`: one send() per message, as applications send, from many threads or
asyncio tasks, each variant against a hand-written baseline driven the same way with the same settings.

A baseline is what a careful user writes without us: the settings ReliableProducer enforces and ends up with
(producer_config()), a delivery callback, and for the threaded ones an rk-id-like header made by the same id
function, so the ratio measures what the outbox and the group commit add, not settings or id costs.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from confluent_kafka import Producer

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.bench.common import BenchRow, Connection, loop_stalls, rows_against
from reliable_kafka.config import producer_config
from reliable_kafka.ids import ID_HEADER, new_id
from reliable_kafka.producer_id import prime_producer_id
from reliable_kafka.testing.loop_stall import LoopStallProbe

BENCH = "producer-calls"
VALUE = b"x" * 100
# Every delivery report back (or flush() done) within this long after the last send, or the run failed.
DRAIN_TIMEOUT_S = 600.0
# The senders' bound: as long as run_variant() gives the whole worker (a slow variant's 1M sends can take
# longer than a drain ever should).
SEND_TIMEOUT_S = 1800.0
# The event-loop probe's sleep: how late it wakes beyond this is how long the loop was kept from it.
PROBE_S = 0.01

# A driver's outcome: seconds from the first send to the last confirmation, and facts for the JSON.
Outcome = tuple[float, dict[str, Any]]
# Senders held at a gate (the event), their threads, and what any of them raised.
Senders = tuple[threading.Event, list[threading.Thread], list[BaseException]]


@dataclass(frozen=True)
class CallVariant:
    """One row of the suite: who sends (raw confluent-kafka or ours), how (threads or tasks), how many."""

    name: str
    baseline: str
    client: str  # "raw" | "reliable"
    concurrency: int
    asyncio: bool = False
    durability: str | None = None  # ours only


# In round order; each baseline before its variants.
VARIANTS: tuple[CallVariant, ...] = (
    CallVariant("raw-threads-16", "raw-threads-16", "raw", 16),
    CallVariant("send-threads-16-process", "raw-threads-16", "reliable", 16, durability="process"),
    CallVariant("send-threads-16-fsync", "raw-threads-16", "reliable", 16, durability="fsync"),
    CallVariant("raw-threads-1", "raw-threads-1", "raw", 1),
    CallVariant("send-threads-1-process", "raw-threads-1", "reliable", 1, durability="process"),
    CallVariant("aio-raw-tasks-200", "aio-raw-tasks-200", "raw", 200, asyncio=True),
    CallVariant("aio-send-tasks-200-process", "aio-raw-tasks-200", "reliable", 200, asyncio=True,
                durability="process"),
    CallVariant("aio-send-tasks-200-memory", "aio-raw-tasks-200", "reliable", 200, asyncio=True,
                durability="memory"),
    # fsync from tasks: the per-call path that needs no thread wake-up per message (the changelog's fsync note)
    CallVariant("aio-send-tasks-200-fsync", "aio-raw-tasks-200", "reliable", 200, asyncio=True,
                durability="fsync"),
)
BY_NAME = {v.name: v for v in VARIANTS}


def shares(n: int, parts: int) -> list[int]:
    """`n` messages split over `parts` senders as evenly as whole messages allow."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def run(variant: CallVariant, connection: Connection, topic: str, n: int) -> Outcome:
    """Run one variant in this process (the bench worker's entry point)."""
    if variant.asyncio:
        coro: Coroutine[Any, Any, Outcome] = (
            _aio_raw(connection, topic, n, variant.concurrency) if variant.client == "raw"
            else _aio_reliable(connection, topic, n, variant.concurrency, variant.durability or "process"))
        return asyncio.run(coro)
    if variant.client == "raw":
        return _raw_threads(connection, topic, n, variant.concurrency)
    return _reliable_threads(connection, topic, n, variant.concurrency, variant.durability or "process")


# ---- threads ------------------------------------------------------------------------------------


def _start_threads(counts: list[int], send_share: Callable[[int], None]) -> Senders:
    """One thread per share, each held at a gate until the clock starts; failures are kept, not lost."""
    go = threading.Event()
    errors: list[BaseException] = []

    def body(count: int) -> None:
        go.wait()
        try:
            send_share(count)
        except BaseException as exc:  # noqa: BLE001 - the run fails with it below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in counts]
    for t in threads:
        t.start()
    return go, threads, errors


def _join(threads: list[threading.Thread], errors: list[BaseException]) -> None:
    deadline = time.monotonic() + SEND_TIMEOUT_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise RuntimeError(f"senders still sending after {SEND_TIMEOUT_S:.0f} s")


def _raw_threads(connection: Connection, topic: str, n: int, threads: int) -> Outcome:
    """Baseline: one confluent-kafka Producer with our settings, `threads` threads each calling produce()
    per message (an rk-id-like header, a delivery callback), a poller thread serving the reports. BufferError
    is waited out by polling and producing again. The clock stops at the last delivery report."""
    p = Producer(producer_config(connection))
    prime_producer_id(p)  # as ReliableProducer's poller does: no variant's clock holds the 0.5 s id wait
    lock = threading.Lock()
    settled = [0, 0]  # delivered, failed
    all_back = threading.Event()

    def on_delivery(err: Any, _msg: Any) -> None:
        with lock:  # the poller serves reports, and so does a sender polling out a full queue
            settled[1 if err is not None else 0] += 1
            if settled[0] + settled[1] == n:
                all_back.set()

    stop = threading.Event()

    def serve_reports() -> None:
        while not stop.is_set():
            p.poll(0.1)

    def send_share(count: int) -> None:
        produce = p.produce
        for _ in range(count):
            headers: list[tuple[str, str | bytes | None]] = [(ID_HEADER, new_id().encode())]
            try:
                produce(topic, VALUE, headers=headers, on_delivery=on_delivery)
            except BufferError:
                produce_when_room(p, topic, VALUE, headers=headers, on_delivery=on_delivery, poll_s=0.01)

    poller = threading.Thread(target=serve_reports, daemon=True)
    poller.start()
    go, senders, errors = _start_threads(shares(n, threads), send_share)
    start = time.perf_counter()
    go.set()
    _join(senders, errors)
    back = all_back.wait(DRAIN_TIMEOUT_S)
    took = time.perf_counter() - start
    stop.set()
    poller.join(5)
    if not back or settled[1]:
        raise RuntimeError(f"raw producer: {settled[0]} of {n} delivered, {settled[1]} failed")
    return took, {}


def _reliable(connection: Connection, outbox_dir: str, durability: str) -> Any:
    from reliable_kafka.producer import ReliableProducer

    kw: dict[str, Any] = {} if durability == "memory" else {"outbox_path": os.path.join(outbox_dir, "bench.db")}
    return ReliableProducer(dict(connection), durability=durability, **kw)


def _commit_facts(stats: Any, n: int) -> dict[str, Any]:
    if stats.sent != n:
        raise RuntimeError(f"stats().sent is {stats.sent}, not {n}")
    return {"commits": stats.commits}


def _reliable_threads(connection: Connection, topic: str, n: int, threads: int, durability: str) -> Outcome:
    """Ours: `threads` threads each calling ReliableProducer.send() per message; the clock stops when
    flush() returns 0 (every message confirmed by all in-sync replicas)."""
    with tempfile.TemporaryDirectory() as d:
        p = _reliable(connection, d, durability)
        p.check_topics([topic])
        p.start()

        def send_share(count: int) -> None:
            send = p.send
            for _ in range(count):
                send(topic, VALUE)

        go, senders, errors = _start_threads(shares(n, threads), send_share)
        start = time.perf_counter()
        go.set()
        _join(senders, errors)
        left = p.flush(DRAIN_TIMEOUT_S)
        took = time.perf_counter() - start
        stats = p.stats()
        p.close()
    if left:
        raise RuntimeError(f"{left} of {n} messages undelivered after {DRAIN_TIMEOUT_S:.0f} s")
    return took, _commit_facts(stats, n)


# ---- asyncio ------------------------------------------------------------------------------------


async def _timed_tasks(n: int, tasks: int, send_share: Callable[[int], Coroutine[Any, Any, None]],
                       drain: Callable[[], Coroutine[Any, Any, None]]) -> tuple[float, LoopStallProbe]:
    """Run the senders and then `drain` with the probe watching; the seconds from the first send to the end
    of `drain`."""
    with LoopStallProbe(PROBE_S) as probe:
        await asyncio.sleep(0)  # the probe's first sleep starts before the senders do
        start = time.perf_counter()
        await asyncio.gather(*(send_share(c) for c in shares(n, tasks)))
        await drain()
        took = time.perf_counter() - start
    return took, probe


async def _aio_raw(connection: Connection, topic: str, n: int, tasks: int) -> Outcome:
    """Baseline: confluent-kafka's AIOProducer with our settings, `tasks` tasks each awaiting produce() per
    message (it returns once the message is buffered, as our send() once it is accepted); the clock stops
    when every delivery future is resolved. AIOProducer refuses headers, so this baseline carries none."""
    from confluent_kafka.aio import AIOProducer

    p = AIOProducer(producer_config(connection))
    inner = getattr(p, "_producer", None)  # AIOProducer's own librdkafka producer (no public handle)
    if inner is not None:
        prime_producer_id(inner)  # as our poller primes ours: no variant's clock holds the 0.5 s id wait
    settled = [0, 0]  # delivered, failed

    def on_done(fut: asyncio.Future[Any]) -> None:
        settled[1 if fut.cancelled() or fut.exception() is not None else 0] += 1

    async def send_share(count: int) -> None:
        produce = p.produce
        for _ in range(count):
            (await produce(topic, VALUE)).add_done_callback(on_done)

    async def drain() -> None:
        await p.flush(DRAIN_TIMEOUT_S)
        # AIOProducer resolves the futures from its executor's threads: their callbacks reach the loop a
        # moment after flush() returned.
        deadline = time.monotonic() + 30
        while settled[0] + settled[1] < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    try:
        took, probe = await _timed_tasks(n, tasks, send_share, drain)
    finally:
        if settled[0] + settled[1] < n:
            await p.purge()  # a failed run: close() flushes without a timeout, and must not wait forever
        await p.close()
    if settled != [n, 0]:
        raise RuntimeError(f"AIOProducer: {settled[0]} of {n} delivered, {settled[1]} failed")
    return took, probe.facts()


async def _aio_reliable(connection: Connection, topic: str, n: int, tasks: int, durability: str) -> Outcome:
    """Ours: AsyncReliableProducer, `tasks` tasks each awaiting send() per message; the clock stops when
    flush() returns 0."""
    from reliable_kafka.producer.aio import AsyncReliableProducer

    with tempfile.TemporaryDirectory() as d:
        kw: dict[str, Any] = {} if durability == "memory" else {"outbox_path": os.path.join(d, "bench.db")}
        p = AsyncReliableProducer(dict(connection), durability=durability, **kw)
        await asyncio.to_thread(p.sync.check_topics, [topic])
        await p.start()
        left = [n]

        async def send_share(count: int) -> None:
            send = p.send
            for _ in range(count):
                await send(topic, VALUE)

        async def drain() -> None:
            left[0] = await p.flush(DRAIN_TIMEOUT_S)

        try:
            took, probe = await _timed_tasks(n, tasks, send_share, drain)
            stats = p.stats()
        finally:
            await p.close()
    if left[0]:
        raise RuntimeError(f"{left[0]} of {n} messages undelivered after {DRAIN_TIMEOUT_S:.0f} s")
    return took, {**_commit_facts(stats, n), **probe.facts()}


# ---- rows ---------------------------------------------------------------------------------------


def rows(runs: dict[str, list[dict[str, Any]]], messages: int) -> list[BenchRow]:
    """Each variant against its own baseline (rows_against per baseline), with what only these rows have:
    every round's ratio, our commits (messages per outbox transaction) and the worst event-loop stall."""
    out: list[BenchRow] = []
    for baseline in dict.fromkeys(v.baseline for v in VARIANTS):
        group = {v.name: runs[v.name] for v in VARIANTS if v.baseline == baseline and v.name in runs}
        base_rates = [r["msgs_per_s"] for r in runs[baseline]]
        for row in rows_against(BENCH, baseline, group, messages):
            results = group[row.variant]
            extra: dict[str, Any] = {
                "ratios": [round(rate / base, 3) for rate, base in zip(row.runs, base_rates, strict=False) if base]}
            if "commits" in results[0]:
                extra["commits"] = [r["commits"] for r in results]
                extra["msgs_per_commit"] = round(statistics.median(messages / max(1, r["commits"]) for r in results), 1)
            extra.update(loop_stalls(results))
            out.append(replace(row, extra=extra))
    return out
