"""One transactional call at a time: retried while next_step() says RETRY, within the time a stop leaves.

Guarantee: a call that fails for good comes back as a Failure value saying how to recover (never as an
exception used to jump), and once a graceful stop is out of time no call is retried any more.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from confluent_kafka import KafkaException

from reliable_kafka import kafka_errors
from reliable_kafka.kafka_errors import Disposition
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.transactions.steps import TxnStep, next_step

log = logging.getLogger("reliable_kafka.transactions")

T = TypeVar("T")

# The shortest timeout a transactional call gets when a graceful stop is nearly out of time.
MIN_CALL_S = 1.0
# A transactional call still inside librdkafka this long past its own timeout is hung, not slow:
# librdkafka 2.x can wait forever in send_offsets_to_transaction() when the group coordinator went
# away mid-call (its timeout is not checked on that path: librdkafka issues #5456 and #5511). Seen here
# when a broker SIGKILL moved the coordinators: the commit thread sat in that call for minutes after
# the broker was back, and the copy stopped. The grace covers what librdkafka legitimately adds to a
# timeout (a request in flight when it expires).
HUNG_GRACE_S = 15.0


class Deadlines:
    """How long one call may take and how long a failing one is retried; both shrink to what is left
    of a graceful stop once it began."""

    def __init__(self, operation_timeout_s: float, stop_timeout_s: float) -> None:
        self.operation_timeout_s = operation_timeout_s
        self.retry_for_s = 2 * operation_timeout_s
        self.stop_timeout_s = stop_timeout_s
        # Set when a graceful stop begins: every transactional call after it shares this deadline.
        self.stop_by: float | None = None

    def start_stop(self) -> None:
        if self.stop_by is None:
            self.stop_by = time.monotonic() + self.stop_timeout_s

    def timeout(self) -> float:
        """One transactional call's timeout: operation_timeout_s, or what is left of a graceful stop."""
        if self.stop_by is None:
            return self.operation_timeout_s
        return max(MIN_CALL_S, min(self.operation_timeout_s, self.stop_by - time.monotonic()))

    def retry_deadline(self) -> float:
        """How long a failing call is retried: twice operation_timeout_s, or what is left of a stop."""
        if self.stop_by is None:
            return self.retry_for_s
        return max(MIN_CALL_S, min(self.retry_for_s, self.stop_by - time.monotonic()))

    def overdue(self) -> bool:
        return self.stop_by is not None and time.monotonic() >= self.stop_by


class CallWatch:
    """Which transactional call one thread is inside now, since when and with what timeout: the loop's
    thread reads it to tell a slow commit (wait on) from a hung one (give it up, see HUNG_GRACE_S)."""

    def __init__(self) -> None:
        # One tuple, replaced whole: the loop's thread reads it without a lock while the committer writes.
        self._current: tuple[str, float, float] | None = None

    def enter(self, operation: str, timeout_s: float) -> None:
        self._current = (operation, time.monotonic(), timeout_s)

    def leave(self) -> None:
        self._current = None

    def hung(self) -> tuple[str, str] | None:
        """(operation, what happened) when the current call is past its timeout plus HUNG_GRACE_S."""
        current = self._current
        if current is None:
            return None
        operation, started, timeout_s = current
        running = time.monotonic() - started
        if running <= timeout_s + HUNG_GRACE_S:
            return None
        return operation, (f"{operation} has not returned {running:.0f}s after it was called with a "
                           f"{timeout_s:.0f}s timeout")


@dataclass(frozen=True, slots=True)
class Failure:
    """A transactional call failed for good; `step` says how to recover."""

    operation: str
    step: TxnStep
    error: KafkaException

    def __str__(self) -> str:
        return f"{self.operation}: {kafka_errors.describe(self.error)} -> {self.step.value}"


def call(operation: str, fn: Callable[[], T], deadlines: Deadlines, owner: str,
         watch: CallWatch | None = None) -> T | Failure:
    """Run one transactional call; retry it while next_step() says RETRY; a Failure if it never succeeds.

    With a `watch`, each attempt is announced on it, so another thread can tell when the call is hung."""
    attempt = fn
    if watch is not None:
        def attempt() -> T:
            watch.enter(operation, deadlines.timeout())
            try:
                return fn()
            finally:
                watch.leave()

    def disposition(exc: KafkaException) -> Disposition:
        if deadlines.overdue():
            return Disposition.FATAL  # a graceful stop is out of time: no more retries
        return Disposition.RETRIABLE if next_step(operation, exc) is TxnStep.RETRY else Disposition.FATAL

    try:
        return retry_kafka_call(
            attempt,
            deadline_s=deadlines.retry_deadline(),
            what=f"{operation} ({owner})",
            classify=disposition,
            retry_on=(Disposition.RETRIABLE,),
            log=log,
        )
    except KafkaException as exc:
        step = next_step(operation, exc)
        if step is TxnStep.RETRY:
            step = TxnStep.RECREATE  # still failing at the deadline: start over from a fresh producer
        return Failure(operation, step, exc)
