"""LoopStallProbe measures how long the event loop was kept from running a task; a stall still going on
when the probe stops is what pending_s() reports (the probe, cancelled, never measures it itself)."""

from __future__ import annotations

import asyncio
import time

from reliable_kafka.testing.loop_stall import LoopStallProbe


def test_a_blocking_call_on_the_loop_is_measured_and_a_free_loop_is_not() -> None:
    async def main() -> tuple[float, float, float]:
        with LoopStallProbe(0.002) as free:
            await asyncio.sleep(0.1)
        with LoopStallProbe(0.002) as blocked:
            await asyncio.sleep(0.01)
            time.sleep(0.3)  # blocks the loop
            await asyncio.sleep(0.01)
        with LoopStallProbe(0.002) as until_the_end:
            await asyncio.sleep(0.01)
            time.sleep(0.3)  # blocks the loop until the probe stops
            still = until_the_end.pending_s()
        return free.worst_s, blocked.worst_s, still

    free, blocked, until_the_end = asyncio.run(main())
    assert free < 0.25  # a loaded host delays a wake-up, never by a blocking 0.3 s
    assert blocked >= 0.25, blocked
    assert until_the_end >= 0.25, until_the_end
