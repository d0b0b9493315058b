"""AsyncReliableProducer refuses bad calls clearly and stores nothing for them. No Kafka."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from reliable_kafka import AsyncReliableProducer, ProducerClosed, SerializationError, WrongEventLoop

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

