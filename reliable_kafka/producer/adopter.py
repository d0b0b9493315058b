"""Drains the slots of the outbox pool that dead or retired processes left with pending messages.

Guarantee: an adopted slot is locked by this process for the whole drain and its rows leave it only on
delivery, exactly as with its first owner; what the drain has not delivered when it stops stays in the
slot, which is unlocked again (by close, or by the kernel if this process dies) for the next adopter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from reliable_kafka.errors import OutboxLocked, ReliableKafkaError
from reliable_kafka.outbox.pool import OutboxPool, SlotStatus

log = logging.getLogger(__name__)

# How often the pool is scanned again after the start: a sibling that dies and is not replaced (a
# deployment that shrinks without a restart) is found within this time.
RESCAN_S = 60.0
# How long one flush() of an adopted slot waits before the stop flag is looked at again.
_TICK_S = 0.5
# What an adopted slot gets, when the owning producer closes, to collect the reports of messages already
# on the wire; the rest stays in the slot (re-sent by the next adopter with the same rk-id).
_CLOSE_GRACE_S = 1.0


class Drain(Protocol):
    """What the adopter needs of a producer opened on one slot (ReliableProducer has it)."""

    def start(self) -> object: ...

    def flush(self, timeout: float | None = None) -> int: ...

    def close(self, timeout: float | None = 30.0) -> int: ...


class SlotAdopter:
    """One background thread that adopts the pool's orphaned slots one at a time and drains each.

    `open_slot(path)` opens a slot as an ordinary producer (it takes the slot's lock, or raises
    OutboxLocked when another process was first); the adopter only chooses slots, waits and closes.
    One slot at a time bounds what adoption costs a process (one extra librdkafka producer); slots
    this process cannot reach yet are left to the other processes of the pool, or to the next scan.
    """

    def __init__(self, pool: OutboxPool, own: Path, open_slot: Callable[[Path], Drain], *,
                 rescan_s: float = RESCAN_S) -> None:
        self._pool = pool
        self._own = own
        self._open_slot = open_slot
        self._rescan_s = rescan_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reliable-kafka-adopter", daemon=True)
        self.adopted: list[Path] = []  # slots this adopter opened, in order (for logs and tests)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 15.0) -> None:
        """Stop draining: the slot being drained is closed (its undelivered rows stay in it) and released."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the outbox pool's adopter did not stop within %.0fs; its slot is released when "
                          "this process exits", timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for slot in self._pool.adoptable(self._own):
                    if self._stop.is_set():
                        return
                    self._adopt(slot)
            except ReliableKafkaError as exc:  # e.g. the directory went away: look again later
                log.error("cannot scan the outbox pool %s: %s", self._pool.directory, exc)
            self._stop.wait(self._rescan_s)

    def _adopt(self, slot: SlotStatus) -> None:
        try:
            producer = self._open_slot(slot.path)
        except OutboxLocked:
            log.debug("outbox slot %s was taken by another process first; it drains it", slot.path)
            return
        except ReliableKafkaError as exc:
            log.error("cannot adopt outbox slot %s (%s pending): %s; it stays for a later adopter",
                      slot.path, slot.pending, exc)
            return
        self.adopted.append(slot.path)
        log.info("adopting outbox slot %s: %s pending message(s) left by a process that is gone",
                 slot.path, slot.pending)
        try:
            producer.start()
            while not self._stop.is_set() and producer.flush(_TICK_S) > 0:
                pass
        finally:
            left = producer.close(_CLOSE_GRACE_S if self._stop.is_set() else 10.0)
        if left:
            log.warning("released outbox slot %s with %d message(s) still pending; the next start adopts it",
                        slot.path, left)
        else:
            log.info("outbox slot %s drained and released", slot.path)
