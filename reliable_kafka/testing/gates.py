"""Fault gates: inject a fault when an observable condition holds, never after a sleep.

A fault proves something only if it lands while the system under test is mid-work. `fire_when` waits
(bounded) for that condition, fires at once, and re-arms (bounded, logged) when the condition did not
come in time; `Feeder` keeps a source topped up so a fast system cannot finish before the last fault.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaException

from reliable_kafka.kafka_errors import Disposition, classify, describe

log = logging.getLogger(__name__)

T = TypeVar("T")


class FaultNotArmed(RuntimeError):
    """The condition a fault waits for never held, even after re-arming: the run cannot prove anything."""


def wait_for(condition: Callable[[], bool], *, timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll `condition` until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def wait_drained(remaining: Callable[[], int], *, stall_s: float, timeout_s: float, poll_s: float = 0.5) -> int:
    """Wait until `remaining()` (work not yet done, e.g. a group's lag) is 0; returns what is left.

    Gated on progress, not on a fixed time: the wait goes on while the work shrinks and gives up only
    when it has not shrunk for `stall_s`, or after `timeout_s` in all. A slow machine then finishes
    the work instead of having its unfinished part counted as lost.
    """
    deadline = time.monotonic() + timeout_s
    best = remaining()
    moved = time.monotonic()
    while best > 0:
        now = time.monotonic()
        if now >= deadline or now - moved >= stall_s:
            log.warning("%d left after %.0fs (no progress for %.0fs)", best, timeout_s - (deadline - now),
                        now - moved)
            return best
        time.sleep(poll_s)
        left = remaining()
        if left < best:
            best, moved = left, time.monotonic()
    return 0


def fire_when(
    ready: Callable[[], bool],
    fire: Callable[[], T],
    *,
    what: str,
    rearm: Callable[[], None] | None = None,
    attempts: int = 3,
    timeout_s: float = 60.0,
    poll_s: float = 0.05,
) -> T:
    """Fire the fault as soon as `ready()` holds; returns what `fire()` returned.

    `ready` is the observable condition that makes the fault bite (the copier holds an open transaction
    with records in it; the consumer has handled records it has not committed). When it does not hold
    within `timeout_s`, `rearm()` (e.g. top up the input) runs and the wait starts again, at most
    `attempts` times, each logged; then `FaultNotArmed`. Without `rearm` there is one attempt.
    """
    tries = attempts if rearm is not None else 1
    for attempt in range(1, tries + 1):
        if wait_for(ready, timeout_s=timeout_s, poll_s=poll_s):
            if attempt > 1:
                log.info("%s: fired on attempt %d", what, attempt)
            return fire()
        if rearm is None or attempt == tries:
            break
        log.warning("%s: the condition did not hold within %.0fs; re-arming (attempt %d of %d)",
                    what, timeout_s, attempt + 1, tries)
        rearm()
    raise FaultNotArmed(f"{what}: the condition for the fault never held ({tries} attempt(s) of {timeout_s:.0f}s)")


class Feeder:
    """Keeps a source ahead of its consumer until stopped, so the work cannot end before the faults do.

    Every `poll_s` it asks `backlog()` (records not yet processed) and calls `top_up()` when it is below
    `low`. Bounded: at most `max_top_ups` calls and `max_seconds` of feeding. Use as a context manager or
    `start()`/`stop()`; `stop()` returns once no top-up is running, so what was fed is final.
    `top_up_now()` runs one top-up at once, serialized with the feeder's own: `fire_when`'s `rearm`.
    """

    def __init__(
        self,
        top_up: Callable[[], None],
        backlog: Callable[[], int],
        *,
        low: int,
        poll_s: float = 0.2,
        max_top_ups: int = 200,
        max_seconds: float = 600.0,
        name: str = "feeder",
    ) -> None:
        self._top_up, self._backlog, self._low = top_up, backlog, low
        self._poll_s, self._max_top_ups, self._max_seconds = poll_s, max_top_ups, max_seconds
        self._stop = threading.Event()
        # One top-up at a time, whoever asks: a source numbered on from what was fed stays in order.
        self._feeding = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.top_ups = 0
        self.error: BaseException | None = None

    def __enter__(self) -> Feeder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Feeder:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._feeding:  # a top_up_now() under way finishes first
            pass
        if self.error is not None:
            raise RuntimeError(f"the feeder failed: {self.error!r}") from self.error

    def top_up_now(self) -> None:
        """Top the source up once, now (e.g. a fault's condition passed before it fired: re-arm it).

        Refused once `stop()` was called: what was fed is final then.
        """
        with self._feeding:
            if self._stop.is_set():
                raise RuntimeError("the feeder is stopped: what was fed is final, nothing more is topped up")
            self._top_up()
            self.top_ups += 1

    def _read_backlog(self) -> float:
        """The backlog, or infinity (no top-up this round) when the look at Kafka failed retriably: a
        committed-offsets request that timed out under load once ended a feeder, and its test with it."""
        try:
            return self._backlog()
        except KafkaException as exc:
            if classify(exc) is not Disposition.RETRIABLE:
                raise
            log.warning("feeder: could not read the backlog (%s); asking again", describe(exc))
            return float("inf")

    def _run(self) -> None:
        deadline = time.monotonic() + self._max_seconds
        try:
            while not self._stop.is_set() and self.top_ups < self._max_top_ups and time.monotonic() < deadline:
                with self._feeding:
                    if not self._stop.is_set() and self._read_backlog() < self._low:
                        self._top_up()
                        self.top_ups += 1
                self._stop.wait(self._poll_s)
        except BaseException as exc:  # surfaced by stop(): a feeder that died must fail the test, not hang it
            self.error = exc
            log.exception("feeder failed")


__all__ = ["FaultNotArmed", "Feeder", "fire_when", "wait_for"]
