"""LoopStallProbe: how long an asyncio event loop was kept from running a ready task.

The benchmarks report it for every asyncio run and the tests of the asyncio front ends bound it: a
front end that runs an outbox commit, a librdkafka call or a slow callback on the loop shows up here.
"""

from __future__ import annotations

import asyncio
from typing import Any

# Linux's per-thread scheduler statistics: "<ns on a CPU> <ns runnable, waiting for a CPU> <timeslices>".
_SCHEDSTAT = "/proc/thread-self/schedstat"


def _cpu_wait_s() -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (None where the kernel does not say)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class LoopStallProbe:
    """A task that sleeps `interval_s` in a loop and keeps its worst overshoot (`worst_s`): the longest
    time the loop was kept from running it, by a blocking call, a long callback or a long run of other
    tasks. Use it inside a running loop: `with LoopStallProbe() as probe: ...`, then `probe.worst_s`.

    `discount_cpu_waits=True` (for tests, on Linux): each overshoot less the time the loop's thread spent
    runnable but waiting for a CPU meanwhile. A host with more runnable threads than cores delays a
    wake-up without any code keeping the loop busy; a blocking call, a long callback or a wait for the GIL
    is not a wait for a CPU, so it still counts in full. `worst_raw_s` keeps the undiscounted worst."""

    def __init__(self, interval_s: float = 0.002, *, discount_cpu_waits: bool = False) -> None:
        self.interval_s = interval_s
        self.worst_s = 0.0
        self.worst_raw_s = 0.0
        self.cpu_wait_s = 0.0  # discounted in all, when discounting
        self._discount = discount_cpu_waits
        self._task: asyncio.Task[None] | None = None
        self._asleep_since: float | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        waited = _cpu_wait_s() if self._discount else None
        while True:
            self._asleep_since = before = loop.time()
            await asyncio.sleep(self.interval_s)
            self._asleep_since = None
            over = loop.time() - before - self.interval_s
            self.worst_raw_s = max(self.worst_raw_s, over)
            if waited is not None:
                now = _cpu_wait_s()
                if now is not None:
                    self.cpu_wait_s += now - waited
                    over -= now - waited
                    waited = now
            self.worst_s = max(self.worst_s, over)

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
