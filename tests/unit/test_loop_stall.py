"""LoopStallProbe measures how long the event loop was kept from running a task; a stall still going on
when the probe stops is what pending_s() reports (the probe, cancelled, never measures it itself)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

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


# A loop whose process gets almost no CPU: pinned to one core beside two busy processes. `body` sets up
# the starvation of its part and defines `main()`, a coroutine that returns its probe; it calls
# `until_measured(probe)` instead of sleeping a fixed time. The probe starts only once both busy
# processes run (each says so), and measures for at least a second and until it has woken a few times
# and seen a starved (late) wake-up: on a loaded host a starved loop may not wake at all in a fixed
# second, and a probe that never woke measures nothing.
_STARVED_CORE = """
import asyncio, json, os, subprocess, sys, threading, time
from reliable_kafka.testing.loop_stall import LoopStallProbe
os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
spin = "import sys, time\\nprint(flush=True)\\nend = time.monotonic() + 120\\nwhile time.monotonic() < end: pass"
busy = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE) for _ in range(2)]
async def until_measured(probe):
    start = time.monotonic()
    while time.monotonic() - start < 60:
        if probe.wakeups >= 3 and probe.worst_raw_s >= 0.05 and time.monotonic() - start >= 1.0:
            break
        await asyncio.sleep(0.05)
try:
    for b in busy:
        b.stdout.readline()  # it runs
{body}
    probe = asyncio.run(main())
    print(json.dumps({{"raw": probe.worst_raw_s, "ours": probe.worst_s, "cpu_wait": probe.cpu_wait_s,
                      "wakeups": probe.wakeups}}))
finally:
    for b in busy:
        b.kill()
        b.wait()
"""


def _starved(body: str) -> dict[str, float]:
    """Run `body` on the starved core in a child process; its probe's raw and discounted worst stall."""
    script = _STARVED_CORE.format(body=body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


# The loop's whole process at SCHED_IDLE.
_LOOP_STARVED = """
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    async def main():
        with LoopStallProbe(0.002, discount_cpu_waits=True) as probe:
            await until_measured(probe)
        return probe
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU-wait discount reads Linux's schedstat")
def test_a_wait_for_a_cpu_is_discounted_and_a_blocking_call_is_not() -> None:
    # Starved of CPU, the loop's wake-ups come late although nothing on it blocks: the raw overshoot
    # shows it, the discounted one does not.
    starved = _starved(_LOOP_STARVED)
    assert starved["raw"] >= 0.05, starved
    assert starved["ours"] < starved["raw"] / 4, starved
    assert starved["cpu_wait"] >= 0.1, starved

    async def blocked() -> LoopStallProbe:
        with LoopStallProbe(0.002, discount_cpu_waits=True) as probe:
            await asyncio.sleep(0.01)
            time.sleep(0.3)  # blocks the loop: not a wait for a CPU, so counted in full
            await asyncio.sleep(0.01)
        return probe

    probe = asyncio.run(blocked())
    assert probe.worst_s >= 0.25, (probe.worst_s, probe.worst_raw_s)


# The same starved core, but the loop's thread runs at normal priority and a second Python thread of
# its process spins at SCHED_IDLE: whenever it is descheduled holding the GIL, the loop waits for it.
_GIL_HOLDER_STARVED = """
    stop = threading.Event()
    def holder():
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        while not stop.is_set():
            pass  # pure Python: it holds the GIL whenever it runs
    async def main():
        with LoopStallProbe(0.002, discount_cpu_waits=True) as probe:
            t = threading.Thread(target=holder)
            t.start()
            await until_measured(probe)
            stop.set()
        t.join()
        return probe
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU-wait discount reads Linux's schedstat")
def test_a_gil_holder_waiting_for_a_cpu_is_discounted() -> None:
    starved = _starved(_GIL_HOLDER_STARVED)
    assert starved["raw"] >= 0.05, starved
    assert starved["ours"] < starved["raw"] / 4, starved
