"""AsyncReliableProducer refuses bad calls clearly and stores nothing for them. No Kafka."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from reliable_kafka import AsyncReliableProducer, ProducerClosed, SerializationError, WrongEventLoop
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


def test_memory_mode_accepts_on_the_loop_while_there_is_room_and_hands_over_when_there_is_none() -> None:
    """Memory mode's accept does no I/O, so while nothing is queued and librdkafka and the spool have room it
    runs on the loop (no writer thread); once librdkafka holds max_in_flight (nothing is delivered: no
    broker), sends go to the writer, whose accept may wait, and the loop keeps running meanwhile."""

    def writer_running() -> bool:
        return any(t.name == "reliable-kafka-group-commit" for t in threading.enumerate())

    async def main() -> tuple[list[int], bool, bool, float]:
        p = AsyncReliableProducer(NOWHERE, durability="memory", preflight="off", max_in_flight=5)
        await p.start()
        seqs = [(await p.send("t", f"v-{i}".encode())).seq for i in range(5)]
        inline_only = not writer_running()
        with LoopStallProbe(0.01) as probe:
            seqs += [s.seq for s in await asyncio.gather(*(p.send("t", f"w-{i}".encode()) for i in range(5)))]
        handed_over = writer_running()
        await p.close(0.1)
        return seqs, inline_only, handed_over, probe.worst_s

    seqs, inline_only, handed_over, worst = asyncio.run(main())
    assert seqs == list(range(1, 11))
    assert inline_only, "memory-mode sends with room went through the writer thread"
    assert handed_over, "sends beyond max_in_flight were accepted on the loop (its accept would wait)"
    assert worst < 0.5, f"the loop stalled {worst:.3f}s while the writer waited for room"


def test_a_task_sending_in_a_loop_on_memory_mode_still_lets_the_loop_run_other_tasks() -> None:
    """A send accepted on the loop does not suspend; without a yield now and then, one task sending 20,000
    messages kept every other task (here a probe) waiting until it was done."""
    async def main() -> tuple[float, float]:
        p = AsyncReliableProducer(NOWHERE, durability="memory", preflight="off", max_in_flight=10**6)
        await p.start()
        p.sync._guard.seen.add("t")  # as after its preflight: every send is accepted on the loop
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
