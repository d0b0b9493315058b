"""Messages waiting for a permission: which topics Kafka refused to this principal, and when to ask again.

A topic the principal may not write (TOPIC_AUTHORIZATION_FAILED) is not a reason to give a message up:
an operator grants the ACL and the same message goes through. So its messages stay pending in the outbox,
held here by topic, while the other topics flow. Once the hold's wait is over one message, the oldest,
goes out as a probe; only when it is no longer refused does the rest follow, in seq order. A topic that
stays denied costs one produce per wait (1 s, doubling to 30 s), not one per held message.

The dispatcher owns the only instance and calls it from its send lock or its poller thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

FIRST_WAIT_S = 1.0
MAX_WAIT_S = 30.0


@dataclass
class _Hold:
    seqs: set[int] = field(default_factory=set)  # held, not handed to librdkafka; the probe is not among them
    wait_s: float = FIRST_WAIT_S
    retry_at: float = 0.0
    probe: int | None = None  # the seq out as a probe, while one is


class AuthorizationHolds:
    """Per topic: the seqs held back while the principal may not write it, and the probe's schedule."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._holds: dict[str, _Hold] = {}
        self.by_topic = self._holds  # read-only to others: empty while nothing is held
        self._clock = clock

    def __bool__(self) -> bool:
        return bool(self._holds)

    def topics(self) -> list[str]:
        return list(self._holds)

    def held(self) -> int:
        """How many messages are held (probes included)."""
        return sum(len(h.seqs) + (h.probe is not None) for h in self._holds.values())

    def refused(self, topic: str, seq: int) -> bool:
        """Kafka refused `seq` for lack of a permission on `topic`: hold it. True when this starts a hold
        (the caller says so once, not per message)."""
        hold = self._holds.get(topic)
        started = hold is None
        if hold is None:
            hold = self._holds[topic] = _Hold()
        if hold.probe == seq:
            # The probe was refused again: still denied. Wait longer before the next one.
            hold.probe = None
            hold.wait_s = min(MAX_WAIT_S, hold.wait_s * 2)
        if hold.probe is None:
            hold.retry_at = self._clock() + hold.wait_s
        hold.seqs.add(seq)
        return started

    def takes(self, topic: str, seq: int) -> bool:
        """Called before `seq` is handed to librdkafka: True when its topic is held (then it joins the hold)
        and it is not the probe."""
        hold = self._holds.get(topic)
        if hold is None or hold.probe == seq:
            return False
        hold.seqs.add(seq)
        return True

    def due_probes(self) -> list[int]:
        """The seqs to send now as probes: the oldest held one of each topic whose wait is over."""
        now, probes = self._clock(), []
        for hold in self._holds.values():
            if hold.probe is None and hold.seqs and now >= hold.retry_at:
                hold.probe = min(hold.seqs)
                hold.seqs.discard(hold.probe)
                probes.append(hold.probe)
        return probes

    def probing(self) -> dict[str, int]:
        """{topic: probe seq} of the holds with a probe out."""
        return {topic: h.probe for topic, h in self._holds.items() if h.probe is not None}

    def release(self, topic: str) -> list[int]:
        """The probe got through (or was settled otherwise): end the hold; returns its seqs in order."""
        hold = self._holds.pop(topic, None)
        return sorted(hold.seqs) if hold is not None else []
