"""AsyncReliableProducer refuses bad calls clearly and stores nothing for them; in memory mode it accepts on the
loop only when that cannot wait, and loses nothing when it cannot. No Kafka."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from reliable_kafka import AsyncReliableProducer, DeliveryFailed, ProducerClosed, SerializationError, WrongEventLoop
from reliable_kafka.testing.loop_stall import LoopStallProbe

NOWHERE = {"bootstrap.servers": "127.0.0.1:1"}


def test_a_value_that_is_not_bytes_raises_and_nothing_is_stored(tmp_path: Path) -> None:
    async def main() -> int:
        async with AsyncReliableProducer(NOWHERE, outbox_path=tmp_path / "o.db", preflight="off") as p:
            with pytest.raises(SerializationError):
                await p.send("t", {"not": "bytes"})
            sent = await p.send("t", b"ok")
            assert sent.seq == 1
            stored = p.stats().sent
            await p.close(0.1)
        return stored

    assert asyncio.run(main()) == 1


def test_send_after_close_raises_producer_closed(tmp_path: Path) -> None:
    async def main() -> None:
        p = AsyncReliableProducer(NOWHERE, durability="memory", preflight="off")
        await p.start()
        await p.start()  # idempotent
        await p.close(0.1)
        assert await p.close(0.1) == 0
        with pytest.raises(ProducerClosed):
            await p.send("t", b"late")

    asyncio.run(main())


def test_a_call_from_another_event_loop_names_both_loops(tmp_path: Path) -> None:
    p = AsyncReliableProducer(NOWHERE, durability="memory", preflight="off")
    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(p.start())

        async def elsewhere() -> None:
            await p.send("t", b"x")

        other = asyncio.new_event_loop()
        try:
            with pytest.raises(WrongEventLoop) as refused:
                other.run_until_complete(elsewhere())
        finally:
            other.close()
        assert repr(first) in str(refused.value) and "called from" in str(refused.value)
        assert p.stats().sent == 0
        first.run_until_complete(p.close(0.1))
    finally:
        first.close()



# ---- memory mode: sends accepted on the loop -------------------------------------------------------


def _writer_running() -> bool:
    return any(t.name == "reliable-kafka-group-commit" for t in threading.enumerate())


async def _memory_producer(**options: Any) -> AsyncReliableProducer:
    config = {**NOWHERE, **options.pop("config", {})}
    p = AsyncReliableProducer(config, durability="memory", preflight="off", **options)
    await p.start()
    p.sync._guard.seen.add("t")  # as after its preflight: the send path, not the first send's
    return p


def test_memory_mode_accepts_on_the_loop_while_there_is_room_and_hands_over_when_there_is_none(
    silent_broker: str,
) -> None:
    """While librdkafka and the spool have room, a memory-mode send is accepted on the loop (no writer
    thread); once librdkafka holds max_in_flight (no broker: nothing is delivered) sends go to the writer,
    whose accept may wait, and the loop keeps running meanwhile. Every message is kept, in order."""

    async def main() -> tuple[list[int], bool, bool, float, int]:
        # "Room" is len(Producer) < max_in_flight, and len() also counts error events nobody has served
        # yet: against a refused port librdkafka queues a "Connection refused" on every reconnect, which
        # took the room of the first five sends now and then (3.13 unit tier in CI). A listener that
        # never answers raises no event for 10 s.
        p = await _memory_producer(config={"bootstrap.servers": silent_broker}, max_in_flight=5)
        # The poller takes the send lock for a moment when it saw a send's rows half handed over; an
        # accept on the loop that finds the lock taken goes to the writer instead (a choice, not a loss).
        # No backlog is left to hand over here (no row waits while there is room; the rows beyond it stay
        # pending), so the poller's hand-over is switched off and the sends with room meet no other thread.
        p.sync._dispatcher._dispatch_backlog = lambda: None  # type: ignore[method-assign]
        seqs = [(await p.send("t", f"v-{i}".encode())).seq for i in range(5)]
        inline_only = not _writer_running()
        with LoopStallProbe(0.01) as probe:
            seqs += [s.seq for s in await asyncio.gather(*(p.send("t", f"w-{i}".encode()) for i in range(5)))]
        handed_over = _writer_running()
        pending = p.sync.pending
        await p.close(0.1)
        return seqs, inline_only, handed_over, probe.worst_s, pending

    seqs, inline_only, handed_over, worst, pending = asyncio.run(main())
    assert seqs == list(range(1, 11)) and pending == 10
    assert inline_only, "memory-mode sends with room went through the writer thread"
    assert handed_over, "sends beyond max_in_flight were accepted on the loop (its accept would wait)"
    assert worst < 0.5, f"the loop stalled {worst:.3f}s while the writer waited for room"


def test_a_full_librdkafka_queue_during_a_send_on_the_loop_loses_nothing() -> None:
    """librdkafka's own queue (3 messages here) fills before max_in_flight: produce() raises BufferError
    on the loop. The message is in the spool all the same (send() returns it), the poller hands it over
    later, and the sends after it, which would only join that backlog, go to the writer."""

    async def main() -> tuple[list[int], int, int, list[str]]:
        p = await _memory_producer(config={"queue.buffering.max.messages": 3}, max_in_flight=10**6)
        sent = [await p.send("t", b"v%d" % i) for i in range(8)]
        rows = p.sync._spool.pending()
        upto, pending = p.sync._dispatcher.dispatched_upto, p.sync.pending
        await p.close(0.1)
        assert [r.message_id for r in rows] == [s.message_id for s in sent]
        return [s.seq for s in sent], upto, pending, [r.value.decode() for r in rows if r.value]

    seqs, upto, pending, values = asyncio.run(main())
    assert seqs == list(range(1, 9))
    assert upto == 3, "librdkafka took more than its queue holds, or fewer"
    assert pending == 8 and values == [f"v{i}" for i in range(8)]


def test_a_message_refused_at_once_on_the_loop_raises_for_that_send_only() -> None:
    """librdkafka refuses a message larger than message.max.bytes in produce(): that send raises
    DeliveryFailed (the message is kept as failed), as the writer's path raises it; the next send goes on."""

    async def main() -> tuple[str, int, int]:
        p = await _memory_producer(config={"message.max.bytes": 1000})
        with pytest.raises(DeliveryFailed) as refused:
            await p.send("t", b"x" * 5000)
        after = await p.send("t", b"small")
        failed = await asyncio.to_thread(p.sync.failed)
        await p.close(0.1)
        assert [r.seq for r in failed] == [1]
        return refused.value.reason, after.seq, len(failed)

    reason, seq, failed = asyncio.run(main())
    assert "MSG_SIZE_TOO_LARGE" in reason
    assert seq == 2 and failed == 1


def test_concurrent_memory_mode_sends_share_one_commit_on_the_loop_and_close_accepts_those_queued() -> None:
    """The sends of one loop pass are accepted in one accept on the loop (no writer thread), each told its
    own seq; sends queued when close() begins are accepted (and counted as left), not refused."""

    async def main() -> tuple[list[int], int, bool, int, int]:
        p = await _memory_producer()
        sent = await asyncio.gather(*(p.send("t", b"v%d" % i) for i in range(200)))
        commits, inline_only = p.stats().commits, not _writer_running()
        queued = [asyncio.create_task(p.send("t", b"q%d" % i)) for i in range(3)]
        await asyncio.sleep(0)  # the three are queued for the pass's commit, which has not run yet
        left = await p.close(0.1)
        late = [(await q).seq for q in queued]
        return [s.seq for s in sent] + late, commits, inline_only, left, p.stats().sent

    seqs, commits, inline_only, left, stored = asyncio.run(main())
    assert seqs == list(range(1, 204))
    assert commits == 1 and inline_only, f"{commits} commits for 200 sends of one pass"
    assert left == stored == 203


def test_a_task_sending_in_a_loop_on_memory_mode_still_lets_the_loop_run_other_tasks() -> None:
    """A send accepted on the loop needs no wait; without its turn for the loop, one task sending 20,000
    messages kept every other task (here a probe) waiting until it was done."""

    async def main() -> tuple[float, float]:
        p = await _memory_producer(max_in_flight=10**6)
        with LoopStallProbe(0.002) as probe:
            await asyncio.sleep(0.01)  # the probe is running
            started = asyncio.get_running_loop().time()
            for i in range(20_000):
                await p.send("t", b"v%d" % i)
            took = asyncio.get_running_loop().time() - started
        await p.close(0.1)
        return probe.worst_s, took

    worst, took = asyncio.run(main())
    assert took > 0.05, f"20,000 sends took {took:.3f}s: too fast for the probe to tell"
    assert worst < took / 2, f"the loop gave the probe no turn for {worst:.3f}s of {took:.3f}s"
