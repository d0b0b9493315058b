"""The `send {topic}` span of each traced message: open from send() until the brokers answer for it.

Only a producer that traces has one (decided once per producer): with tracing off no message pays for it.
The span's context rides in the message's `traceparent` header, which the outbox stores, so a message
re-sent after a crash or restart stays in its trace: its delivery is then a `send` span of that trace.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from reliable_kafka import telemetry

log = logging.getLogger(__name__)

# Spans held open at most (brokers away, a backlog): beyond it a span ends at acceptance with an event
# saying so, so that tracing never holds the outbox's backlog in memory a second time.
MAX_OPEN = 10_000

# The event every answer of the brokers adds, and the values of its outcome attribute.
EVENT = "delivery"
OUTCOME = "reliable_kafka.delivery.outcome"
REASON = "reliable_kafka.delivery.reason"


class SendSpans:
    """Open send spans by message id. Thread-safe: send() threads start them, the poller settles them."""

    def __init__(self, max_open: int = MAX_OPEN) -> None:
        self._lock = threading.Lock()
        # A list per id: a caller's idempotency key may be sent twice, and each send has its own span.
        self._open: dict[str, deque[Span]] = {}
        self._count = 0
        self._max_open = max_open

    def start(self, topic: str, message_id: str, key: Any, headers: list[tuple[str, bytes]]) -> None:
        """Start the span of a message being accepted and append its context to the message's headers."""
        span = telemetry.start_send_span(topic, message_id, key)
        telemetry.inject(span, headers)
        with self._lock:
            if self._count < self._max_open:
                self._open.setdefault(message_id, deque()).append(span)
                self._count += 1
                return
        span.add_event(EVENT, {OUTCOME: "untracked", REASON: f"more than {self._max_open} sends open"})
        span.end()

    def _take(self, message_id: str | None) -> Span | None:
        if message_id is None:
            return None
        with self._lock:
            spans = self._open.get(message_id)
            if not spans:
                return None
            span = spans.popleft()
            if not spans:
                del self._open[message_id]
            self._count -= 1
            return span

    def _peek(self, message_id: str | None) -> Span | None:
        with self._lock:
            spans = self._open.get(message_id) if message_id is not None else None
            return spans[0] if spans else None

    def _resumed(self, topic: str, message_id: str | None, headers: Sequence[tuple[str, Any]]) -> Span:
        """A send span for a message this producer did not accept (an earlier run's, from the outbox):
        a child of the context its headers carry, so it joins the original trace."""
        return telemetry.start_send_span(topic, message_id or "", parent=telemetry.extract(headers),
                                         **{"reliable_kafka.resent_from_outbox": True})

    def delivered(self, message_id: str, topic: str, headers: Sequence[tuple[str, Any]], partition: int,
                  offset: int) -> None:
        """The brokers acknowledged a message (its stored headers, where it landed): end its span."""
        span = self._take(message_id) or self._resumed(topic, message_id, headers)
        span.set_attribute("messaging.destination.partition.id", str(partition))
        span.set_attribute("messaging.kafka.offset", offset)
        span.add_event(EVENT, {OUTCOME: "delivered"})
        span.end()

    def retried(self, message_id: str, reason: str) -> None:
        """A retriable failure: the span stays open, the attempt is an event on it."""
        span = self._peek(message_id)
        if span is not None:
            span.add_event(EVENT, {OUTCOME: "retried", REASON: reason})

    def failed(self, message_id: str, topic: str, headers: Sequence[tuple[str, Any]], reason: str) -> None:
        """Kafka refused the message for good (it stays in the outbox as failed): end its span in error."""
        span = self._take(message_id) or self._resumed(topic, message_id, headers)
        span.set_attribute("error.type", telemetry.error_type(reason))
        span.add_event(EVENT, {OUTCOME: "failed", REASON: reason})
        span.set_status(Status(StatusCode.ERROR, reason))
        span.end()

    def close(self) -> None:
        """The producer closes: end what is still open; those messages stay in the outbox (or, in memory
        mode, are lost) and a later run's delivery of them is a send span of the same trace."""
        with self._lock:
            spans = [s for q in self._open.values() for s in q]
            self._open.clear()
            self._count = 0
        for span in spans:
            span.add_event(EVENT, {OUTCOME: "pending_at_close"})
            span.end()
