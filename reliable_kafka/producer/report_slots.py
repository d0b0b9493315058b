"""Delivery callbacks that are reused instead of made per message: the dispatcher's one hot-path trick.

librdkafka reports each produced message exactly once, to the callback given to its produce(); the report
carries no headers, so the callback itself must say which message it was (its seq, the producer generation
that sent it, its topic). A functools.partial per message did that. Each partial was an object the garbage
collector tracks, alive for as long as its message is in flight (up to max_in_flight of them), so every
send() moved the process towards a collection and every in-flight message was one more object each full
collection walks. A slot here is an object with those three fields, taken from a free list at produce()
and put back by its own call: once the list has grown to the in-flight count, a send() allocates no
tracked object that outlives it, and the collector has nothing to do for it.

Measured (CHANGELOG, "Objects the garbage collector tracks"), with the outbox's untracked journal entries:
300,000 send()s from one thread, `process`, against the librdkafka mock, ran 1,841 young, 168 middle and 15
full collections (~610 ms, 2 us a send) before and 471, 43 and 2 (~90 ms) after; 16 threads on a 3-node
cluster sent 86,619 msgs/s against 74,347 (CHANGELOG).

A slot is taken under the dispatcher's send lock and given back on the thread that serves reports; a slot
whose produce() raised is never referenced by librdkafka and is simply dropped, so no slot is ever handed
out while a report may still reach it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (seq, generation, topic, err, msg): Dispatcher._on_delivery's signature.
Report = Callable[[int, int, str, Any, Any], None]


class ReportSlot:
    """The delivery callback of one in-flight message; back in its pool once called."""

    __slots__ = ("seq", "generation", "topic", "_report", "_delivered", "_free")

    def __init__(self, report: Report, delivered: Callable[[int], None] | None, free: list[ReportSlot]) -> None:
        self.seq = 0
        self.generation = 0
        self.topic = ""
        self._report = report
        self._delivered = delivered
        self._free = free

    def __call__(self, err: Any, msg: Any) -> None:
        seq = self.seq
        if err is None and self._delivered is not None:
            # A success only notes its seq, without a second Python call (into `report`, five arguments):
            # the poller takes the GIL for every report, and shares it with the senders.
            self._free.append(self)
            self._delivered(seq)
            return
        generation, topic = self.generation, self.topic
        self._free.append(self)  # its fields are read: it may be taken again at once
        self._report(seq, generation, topic, err, msg)


class ReportSlots:
    """Slots calling `report`, reused across messages (the free list grows to the most ever in flight).

    `delivered`, when given, takes the seq of each success instead of `report` (which then sees failures
    only); None sends every report to `report` (a producer that traces settles each send span there).
    """

    def __init__(self, report: Report, delivered: Callable[[int], None] | None = None) -> None:
        self._report = report
        self._delivered = delivered
        self._free: list[ReportSlot] = []

    def take(self, seq: int, generation: int, topic: str) -> ReportSlot:
        try:
            slot = self._free.pop()
        except IndexError:
            slot = ReportSlot(self._report, self._delivered, self._free)
        slot.seq, slot.generation, slot.topic = seq, generation, topic
        return slot
