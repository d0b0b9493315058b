"""LoopStallProbe: how long an asyncio event loop was kept from running a ready task.

The benchmarks report it for every asyncio run and the tests of the asyncio front ends bound it: a
front end that runs an outbox commit, a librdkafka call or a slow callback on the loop shows up here.
"""

from __future__ import annotations

import asyncio
from typing import Any


class LoopStallProbe:
    """A task that sleeps `interval_s` in a loop and keeps its worst overshoot (`worst_s`): the longest
    time the loop was kept from running it, by a blocking call, a long callback or a long run of other
    tasks. Use it inside a running loop: `with LoopStallProbe() as probe: ...`, then `probe.worst_s`."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.worst_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._asleep_since: float | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._asleep_since = before = loop.time()
            await asyncio.sleep(self.interval_s)
            self._asleep_since = None
            self.worst_s = max(self.worst_s, loop.time() - before - self.interval_s)

    def __enter__(self) -> LoopStallProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    def pending_s(self) -> float:
        """How late the probe's current wait is now (0 when it is not waiting): a stall still going on,
        which the probe, once stopped, never measures itself. Not part of `worst_s` (see docs/testing.md)."""
        if self._asleep_since is None:
            return 0.0
        return max(0.0, asyncio.get_running_loop().time() - self._asleep_since - self.interval_s)

    def facts(self) -> dict[str, Any]:
        """The worst stall for a benchmark's JSON, in milliseconds."""
        return {"loop_stall_max_ms": round(self.worst_s * 1000, 1)}
