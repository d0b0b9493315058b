"""LoopStallProbe: how long an asyncio event loop was kept from running a ready task.

The benchmarks report it for every asyncio run and the tests of the asyncio front ends bound it: a
front end that runs an outbox commit, a librdkafka call or a slow callback on the loop shows up here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Any

# Linux's per-thread scheduler statistics: "<ns on a CPU> <ns runnable, waiting for a CPU> <timeslices>".
_SCHEDSTAT = "/proc/self/task/{}/schedstat"


class _PythonThreadWaits:
    """How long each Python thread of this process has waited for a CPU (ns), read from open files.

    Only Python threads: they are the ones that can hold the GIL the loop needs. A thread descheduled
    while it holds it keeps the loop waiting exactly as long as it waits for a CPU itself. librdkafka's
    and other native threads never hold it. One pread per thread (about 1.5 us; opening the files on
    each read would cost 40 us a thread), the thread list is looked at every `_REFRESH_EVERY` reads.
    """

    _REFRESH_EVERY = 50

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self._reads = 0

    def _refresh(self) -> None:
        alive = {t.native_id for t in threading.enumerate() if t.native_id is not None}
        alive.add(threading.get_native_id())
        for tid in set(self._fds) - alive:
            os.close(self._fds.pop(tid))
        for tid in alive - set(self._fds):
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                self._fds[tid] = os.open(_SCHEDSTAT.format(tid), os.O_RDONLY)

    def read(self) -> dict[int, int] | None:
        """{thread id: ns waited for a CPU}, or None where the kernel does not say."""
        if self._reads % self._REFRESH_EVERY == 0:
            self._refresh()
            if not self._fds:
                return None
        self._reads += 1
        waits = {}
        for tid, fd in list(self._fds.items()):
            try:
                waits[tid] = int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):  # the thread ended
                os.close(self._fds.pop(tid))
        return waits

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _longest_wait_s(before: dict[int, int], after: dict[int, int]) -> float:
    """The longest any one thread waited for a CPU between two reads (threads in both)."""
    return max((after[tid] - before[tid] for tid in after.keys() & before.keys()), default=0) / 1e9


class LoopStallProbe:
    """A task that sleeps `interval_s` in a loop and keeps its worst overshoot (`worst_s`): the longest
    time the loop was kept from running it, by a blocking call, a long callback or a long run of other
    tasks. Use it inside a running loop: `with LoopStallProbe() as probe: ...`, then `probe.worst_s`.

    `discount_cpu_waits=True` (for tests, on Linux): each overshoot less the longest time one Python
    thread of the process (the loop's own, or one holding the GIL the loop needs) spent runnable but
    waiting for a CPU meanwhile. A host with more runnable threads than cores delays a wake-up without
    any code keeping the loop busy, and a thread it deschedules while it holds the GIL keeps the loop
    waiting as long. A blocking call, a long callback or a GIL held by a thread that runs (a C call that
    does not release it) is not a wait for a CPU, so it still counts in full. `worst_raw_s` keeps the
    undiscounted worst."""

    def __init__(self, interval_s: float = 0.002, *, discount_cpu_waits: bool = False) -> None:
        self.interval_s = interval_s
        self.worst_s = 0.0
        self.worst_raw_s = 0.0
        self.cpu_wait_s = 0.0  # discounted in all, when discounting
        self.wakeups = 0  # completed waits: lets a caller wait for the probe to have measured something
        self._discount = discount_cpu_waits
        self._task: asyncio.Task[None] | None = None
        self._asleep_since: float | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        threads = _PythonThreadWaits() if self._discount else None
        waited = threads.read() if threads is not None else None
        try:
            while True:
                self._asleep_since = before = loop.time()
                await asyncio.sleep(self.interval_s)
                self._asleep_since = None
                self.wakeups += 1
                over = loop.time() - before - self.interval_s
                self.worst_raw_s = max(self.worst_raw_s, over)
                if threads is not None and waited is not None:
                    now = threads.read()
                    if now is not None:
                        wait = min(max(over, 0.0), _longest_wait_s(waited, now))
                        self.cpu_wait_s += wait
                        over -= wait
                        waited = now
                self.worst_s = max(self.worst_s, over)
        finally:
            if threads is not None:
                threads.close()

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
