"""AsyncReliableConsumer without a broker: its parts (RetryPolicy.run_async, the loop strategy) alone, and the
whole front end over a scripted client (records in, commits out): per-key order, bounded concurrency, commits
of only what finished through a cancellation, retries then the DLQ off the loop, and the loop refusals."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Message, TopicPartition

from reliable_kafka import AsyncReliableConsumer, ClientClosed, InputRefused, RetryPolicy, WrongEventLoop
from reliable_kafka.consumer.strategies import LoopStrategy
from reliable_kafka.errors import RetriesExhausted, RetryInterrupted
from reliable_kafka.testing.loop_stall import LoopStallProbe
from tests.fixtures.consumer_parts import T, parts

NOWHERE = {"bootstrap.servers": "127.0.0.1:1", "group.id": "unit"}
log = logging.getLogger(__name__)


# ---- RetryPolicy.run_async ------------------------------------------------------------------------

def test_run_async_retries_then_gives_up_with_the_attempts_counted() -> None:
    calls = []

    async def failing() -> None:
        calls.append(1)
        raise ValueError("no")

    async def main() -> RetriesExhausted:
        with pytest.raises(RetriesExhausted) as raised:
            await RetryPolicy(attempts=3, initial_backoff_s=0.001, jitter=False).run_async(failing)
        return raised.value

    exc = asyncio.run(main())
    assert (len(calls), exc.attempts, type(exc.last_error)) == (3, 3, ValueError)


def test_run_async_stop_cuts_the_backoff_short_and_cancellation_is_no_failure() -> None:
    async def failing() -> None:
        raise ValueError("no")

    async def main() -> None:
        stop = asyncio.Event()
        policy = RetryPolicy(attempts=5, initial_backoff_s=30, max_backoff_s=30, jitter=False)
        task = asyncio.create_task(policy.run_async(failing, stop_event=stop))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        stop.set()
        with pytest.raises(RetryInterrupted) as interrupted:
            await task
        assert time.monotonic() - started < 1 and interrupted.value.attempts == 1

        blocked = asyncio.Event()

        async def hangs() -> None:
            await blocked.wait()

        task = asyncio.create_task(policy.run_async(hangs))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


# ---- the loop strategy alone ----------------------------------------------------------------------

def test_lanes_run_one_key_in_order_and_complete_only_what_finished() -> None:
    p = parts(retry=RetryPolicy(attempts=1))
    seen: dict[bytes, list[int]] = defaultdict(list)
    gate = asyncio.Event()

    async def handler(msg: Message) -> None:
        if msg.offset() == 3:
            await gate.wait()  # offset 3 is unfinished
        seen[msg.key()].append(msg.offset())  # type: ignore[index]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lanes = LoopStrategy(handler, 4, loop, asyncio.Event(), lambda *a: loop.run_in_executor(None, *a),
                             fetcher=p.fetcher, failures=p.failures, commits=p.commits)
        lanes.start()
        msgs = [Message(topic=T, partition=0, offset=o, key=f"k{o % 3}".encode()) for o in range(12)]
        await asyncio.to_thread(lanes.handle_fetched, msgs)  # from a thread, as the fetch thread does
        for _ in range(200):
            if p.counters.get("handled") == 11:
                break
            await asyncio.sleep(0.01)
        assert p.commits.committable() == {(T, 0): 3}, "committed past the unfinished offset 3"
        gate.set()
        assert await asyncio.to_thread(lanes.wait_idle, 5)
        await lanes.cancel()

    asyncio.run(main())
    assert p.commits.committable() == {(T, 0): 12}
    assert {k: v for k, v in seen.items()} == {f"k{i}".encode(): list(range(i, 12, 3)) for i in range(3)}


def test_records_waiting_in_a_lane_when_their_partition_is_released_are_left_for_the_new_owner() -> None:
    p = parts(retry=RetryPolicy(attempts=1))  # revoke_timeout_s=1
    gate = asyncio.Event()
    ran: list[tuple[int, int]] = []

    async def handler(msg: Message) -> None:
        if (msg.partition(), msg.offset()) == (0, 0):
            await gate.wait()  # still running when the revoke gives up waiting
        ran.append((msg.partition(), msg.offset()))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lanes = LoopStrategy(handler, 2, loop, asyncio.Event(), lambda *a: loop.run_in_executor(None, *a),
                             fetcher=p.fetcher, failures=p.failures, commits=p.commits)
        p.rebalance.wait_idle = lanes.wait_idle  # as run() sets it
        lanes.start()
        # One key per partition: partition 0's records queue behind offset 0 in one lane.
        msgs = [Message(topic=T, partition=part, offset=o, key=f"k{part}".encode())
                for part in (0, 1) for o in range(6)]
        await asyncio.to_thread(lanes.handle_fetched, msgs)
        await asyncio.to_thread(p.rebalance.on_revoke, None, [TopicPartition(T, 0)])  # times out after 1 s
        gate.set()
        for _ in range(500):
            if p.counters.get("left_for_new_owner") == 5 and p.counters.get("handled") == 7:
                break
            await asyncio.sleep(0.01)
        await lanes.cancel()

    asyncio.run(main())
    assert [r for r in ran if r[0] == 0] == [(0, 0)], "records queued behind the revoke ran after it"
    assert sorted(r for r in ran if r[0] == 1) == [(1, o) for o in range(6)]
    assert p.counters.get("left_for_new_owner") == 5
    assert p.client.commits == []  # offset 0 still ran at the revoke: nothing of partition 0 was committable
    assert p.commits.committable() == {(T, 1): 6}


# ---- the whole front end over a scripted client ---------------------------------------------------

class ScriptedClient:
    """Stands in for confluent_kafka.Consumer: hands out `records` in batches, records commits, and
    notes the thread of every call (none may run on the event loop's)."""

    def __init__(self, real: Any, records: list[Message]) -> None:
        self._real = real
        self._records = list(records)
        self.commits: list[dict[tuple[str, int], int]] = []
        self.threads: set[str] = set()
        self._on_assign: Callable[..., None] | None = None
        self._on_revoke: Callable[..., None] | None = None
        self._assigned = False
        self._unsubscribed = False
        partitions = sorted({(m.topic(), m.partition()) for m in records})
        self._tps = [TopicPartition(t, p) for t, p in partitions]

    def _note(self) -> None:
        self.threads.add(threading.current_thread().name)

    def subscribe(self, topics: list[str], on_assign: Callable[..., None], on_revoke: Callable[..., None],
                  **_: Any) -> None:
        self._note()
        self._on_assign, self._on_revoke = on_assign, on_revoke

    def unsubscribe(self) -> None:
        """As librdkafka: the revoke comes with the next consume(), then the member has left."""
        self._note()
        self._unsubscribed = True

    def memberid(self) -> str | None:
        return None if self._unsubscribed and not self._assigned else "member-1"

    def consume(self, n: int, timeout: float) -> list[Message]:
        self._note()
        if self._unsubscribed:
            if self._assigned and self._on_revoke is not None:
                self._assigned = False
                self._on_revoke(self, self._tps)
            return []
        if not self._assigned and self._on_assign is not None:
            self._assigned = True
            self._on_assign(self, self._tps)
        out, self._records = self._records[:n], self._records[n:]
        if not out:
            time.sleep(min(timeout, 0.05))
        return out

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition]:
        self._note()
        self.commits.append({(tp.topic, tp.partition): tp.offset for tp in offsets})
        return offsets

    def committed_now(self) -> dict[tuple[str, int], int]:
        merged: dict[tuple[str, int], int] = {}
        for c in self.commits:
            merged.update(c)
        return merged

    def assignment(self) -> list[TopicPartition]:
        return self._tps if self._assigned else []

    def pause(self, partitions: list[TopicPartition]) -> None:
        pass

    def resume(self, partitions: list[TopicPartition]) -> None:
        pass

    def close(self) -> None:
        self._note()
        self._real.close()


def scripted(records: list[Message], **kwargs: Any) -> tuple[AsyncReliableConsumer, ScriptedClient]:
    consumer = AsyncReliableConsumer(NOWHERE, [T], **kwargs)
    sync = consumer.sync
    client = ScriptedClient(sync._client, records)
    sync._client = sync._commits._client = sync._fetcher._client = client  # type: ignore[assignment]
    sync._rebalance.client = client  # type: ignore[assignment]
    return consumer, client


def keyed(n: int, partitions: int = 3, keys: int = 7) -> list[Message]:
    return [Message(topic=T, partition=o % partitions, offset=o // partitions, key=f"k{o % keys}".encode(),
                    value=f"v{o}".encode()) for o in range(n)]


def test_run_handles_every_record_once_per_key_in_order_with_bounded_concurrency_and_commits_the_end() -> None:
    records = keyed(3_000)
    consumer, client = scripted(records, concurrency=8)
    seen: list[Message] = []
    running, most = [0], [0]

    async def handler(msg: Message) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0)
        seen.append(msg)
        running[0] -= 1
        if len(seen) == len(records):
            consumer.stop()

    async def main() -> float:
        with LoopStallProbe(discount_cpu_waits=True) as probe:
            async with consumer:
                await asyncio.wait_for(consumer.run(handler), 30)
        return probe.worst_s

    worst = asyncio.run(main())
    log.info("3000 records, 8 lanes: worst event-loop stall %.1f ms", worst * 1000)
    assert sorted(m.value() for m in seen) == sorted(m.value() for m in records)  # type: ignore[type-var]
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for m in seen:
        by_key[m.key()].append(int(m.value()[1:]))  # type: ignore[index,arg-type]
    assert all(v == sorted(v) for v in by_key.values()), "a key's records ran out of delivery order"
    assert 1 < most[0] <= 8
    assert client.committed_now() == {(T, p): 1_000 for p in range(3)}
    assert not any(name.startswith("MainThread") for name in client.threads), client.threads
    assert worst < 0.5, f"the loop stalled {worst * 1000:.0f} ms"


def test_cancelling_run_lets_inflight_handlers_finish_and_commits_exactly_what_finished() -> None:
    records = [Message(topic=T, partition=0, offset=o, key=f"k{o}".encode()) for o in range(100)]
    consumer, client = scripted(records, concurrency=4, revoke_timeout_s=1.0)
    finished: list[int] = []
    release = asyncio.Event()

    async def handler(msg: Message) -> None:
        offset = msg.offset()
        assert offset is not None
        if offset >= 20:
            await release.wait()  # in flight when the cancel comes
        if offset >= 30:
            await asyncio.sleep(3600)  # never finishes: cut at the bound, never committed
        finished.append(offset)

    async def main() -> None:
        task = asyncio.create_task(consumer.run(handler))
        for _ in range(500):  # gated on what was handled, bounded
            if len(finished) == 20:
                break
            await asyncio.sleep(0.01)
        assert len(finished) == 20
        task.cancel()
        await asyncio.sleep(0.1)
        release.set()  # the handlers in flight finish after the cancel
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 20)
        await consumer.close()

    asyncio.run(main())
    assert sorted(finished) == list(range(30))
    assert client.committed_now() == {(T, 0): 30}, "committed other than exactly what finished"


def test_a_failing_handler_is_retried_then_dead_lettered_off_the_loop_and_the_rest_goes_on() -> None:
    records = [Message(topic=T, partition=0, offset=o, value=f"v{o}".encode()) for o in range(10)]
    consumer, client = scripted(records, retry=RetryPolicy(attempts=3, initial_backoff_s=0.01, jitter=False))
    attempts: dict[int, int] = defaultdict(int)
    dead: list[tuple[int, int, str]] = []
    handled: list[int] = []

    def write(w: Any, error: BaseException, n: int) -> None:
        time.sleep(0.3)  # a slow acknowledgement: it must not stall the loop
        dead.append((w.msg.offset(), n, threading.current_thread().name))

    consumer.sync._failures.dead_letters.write = write  # type: ignore[method-assign]

    async def handler(msg: Message) -> None:
        offset = msg.offset()
        assert offset is not None
        attempts[offset] += 1
        if offset == 4:
            raise ValueError("poison")
        handled.append(offset)
        if len(handled) == 9 and dead:
            consumer.stop()

    async def main() -> float:
        with LoopStallProbe(discount_cpu_waits=True) as probe:
            async with consumer:
                await asyncio.wait_for(consumer.run(handler, stop_after=15), 30)
        return probe.worst_s

    worst = asyncio.run(main())
    log.info("a 300 ms dead-letter write: worst event-loop stall %.1f ms", worst * 1000)
    assert attempts[4] == 3 and len(dead) == 1 and dead[0][:2] == (4, 3)
    assert dead[0][2].startswith("reliable-kafka-aio"), dead
    assert handled == [o for o in range(10) if o != 4]
    assert consumer.stats().dead_lettered == 1 and consumer.stats().handled == 10
    assert client.committed_now() == {(T, 0): 10}
    assert worst < 0.2, f"the loop stalled {worst * 1000:.0f} ms during a 300 ms dead-letter write"


def test_commit_while_run_runs_is_refused_and_assignment_asks_no_librdkafka_call() -> None:
    consumer, client = scripted([Message(topic=T, partition=p, offset=0) for p in range(3)])
    refused: list[BaseException] = []
    held: list[list[tuple[str, int]]] = []

    async def handler(msg: Message) -> None:
        held.append(consumer.assignment)
        try:
            await consumer.commit()
        except InputRefused as exc:
            refused.append(exc)
        if len(refused) == 3:
            consumer.stop()

    async def main() -> None:
        async with consumer:
            await asyncio.wait_for(consumer.run(handler), 20)
            assert await consumer.commit() == {}  # after run(): allowed (run() committed everything)

    asyncio.run(main())
    assert len(refused) == 3 and "run() commits by itself" in str(refused[0])
    assert held[0] == [(T, 0), (T, 1), (T, 2)]
    assert client.committed_now() == {(T, p): 1 for p in range(3)}


def test_async_for_counts_a_record_processed_when_the_body_asks_for_the_next() -> None:
    records = [Message(topic=T, partition=0, offset=o) for o in range(10)]
    consumer, client = scripted(records)

    async def main() -> None:
        async with consumer:
            async for msg in consumer:
                if msg.offset() == 6:
                    break  # 6 is not processed
            await consumer.commit()

    asyncio.run(main())
    assert client.committed_now() == {(T, 0): 6}


def test_a_call_from_another_loop_or_after_close_is_refused() -> None:
    consumer = AsyncReliableConsumer(NOWHERE, [T])
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(consumer.start())
        other = asyncio.new_event_loop()
        try:
            with pytest.raises(WrongEventLoop) as refused:
                other.run_until_complete(consumer.commit())
        finally:
            other.close()
        assert repr(first) in str(refused.value)
        first.run_until_complete(consumer.close(1))
        first.run_until_complete(consumer.close(1))  # a second close does nothing

        async def late() -> None:
            async for _ in consumer:
                pass

        with pytest.raises(ClientClosed):
            first.run_until_complete(late())
    finally:
        first.close()


def test_a_handler_raising_systemexit_stops_the_consumer_and_run_raises_it_without_committing_the_record() -> None:
    records = [Message(topic=T, partition=0, offset=o) for o in range(10)]
    consumer, client = scripted(records, revoke_timeout_s=1.0)

    async def handler(msg: Message) -> None:
        if msg.offset() == 3:
            raise SystemExit(3)

    async def main() -> None:
        async with consumer:
            with pytest.raises(SystemExit):  # awaited in this task: SystemExit out of a task ends the loop
                await consumer.run(handler, stop_after=20)

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 10, "the consumer went on after the handler's SystemExit"
    assert client.committed_now() == {(T, 0): 3}
