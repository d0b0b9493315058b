"""Retry policies on tenacity: handler retries (RetryPolicy) and Kafka client call retries (retry_kafka_call).

Guarantee: a failure is never swallowed: it ends as a result, RetriesExhausted (poison), RetryInterrupted
(stop requested: unfinished, not poison) or the original error, after a bounded number of attempts or time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import KafkaException
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_random_exponential,
)

from reliable_kafka import kafka_errors
from reliable_kafka.errors import ConfigError, PartitionFenced, RetriesExhausted, RetryInterrupted
from reliable_kafka.kafka_errors import Disposition

logger = logging.getLogger(__name__)

T = TypeVar("T")


class _StopRequested(Exception):
    """Raised by the backoff sleep when the stop event is set; turned into RetryInterrupted by run()."""


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a handler is retried before its record counts as poison.

    Attempt n (n >= 1) that fails is followed by a backoff of min(max_backoff_s, initial_backoff_s *
    2**(n-1)) seconds, or with `jitter` a uniformly random time between 0 and that ("full jitter", so
    many consumers failing on the same dependency do not retry in lockstep).

    An exception is retried when it is an instance of `retry_on` and not of `give_up_on`; any other
    Exception makes the record poison at once. BaseExceptions that are not retried (KeyboardInterrupt,
    SystemExit) propagate unchanged: they are the process stopping, not the record failing.
    """

    attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    jitter: bool = True
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    give_up_on: tuple[type[BaseException], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise ConfigError(
                "attempts", f"must be an integer >= 1 (the first call counts), got {self.attempts!r}"
            )
        if self.initial_backoff_s < 0:
            raise ConfigError("initial_backoff_s", f"must be >= 0, got {self.initial_backoff_s!r}")
        if self.max_backoff_s < self.initial_backoff_s:
            raise ConfigError(
                "max_backoff_s",
                f"must be >= initial_backoff_s ({self.initial_backoff_s}), got {self.max_backoff_s!r}",
            )
        for key in ("retry_on", "give_up_on"):
            for kind in getattr(self, key):
                if not (isinstance(kind, type) and issubclass(kind, BaseException)):
                    raise ConfigError(key, f"must be a tuple of exception classes, got {kind!r}")

    def _worth_retrying(self, error: BaseException) -> bool:
        # RetryInterrupted from inside fn is a stop request travelling outwards: never retry it. Nor
        # PartitionFenced: another consumer owns the partition now, no retry of this one can succeed.
        return (
            isinstance(error, self.retry_on)
            and not isinstance(error, self.give_up_on)
            and not isinstance(error, (RetryInterrupted, PartitionFenced))
        )

    def run(
        self,
        fn: Callable[[], T],
        *,
        stop_event: threading.Event | None = None,
        label: str = "handler",
        first_error: BaseException | None = None,
    ) -> T:
        """Call `fn` until it succeeds; return its result.

        Raises RetriesExhausted(last_error, attempts) when the last attempt fails or an error is not worth
        retrying: the record is poison. When `stop_event` is set during a backoff the wait is cut short
        and RetryInterrupted is raised instead: the record is unfinished, not poison, so its offset must
        not be committed nor the record dead-lettered; it is delivered again after the restart or
        rebalance. The stop event never interrupts a running attempt, and a first attempt always runs.
        `label` names the work in log lines (e.g. "orders[3]@1042"). `first_error`: the caller already
        made the first attempt, which raised this; retrying starts from there.
        """
        # The first attempt runs bare: it is the per-record hot path of every consumer, and tenacity's
        # machinery costs several times a cheap handler. Only a failure enters it, replayed as attempt 1.
        if first_error is None:
            try:
                return fn()
            except BaseException as exc:
                first_error = exc
        attempts = _Attempts(self, label, first_error)
        event = stop_event if stop_event is not None else threading.Event()

        def backoff_sleep(seconds: float) -> None:
            if event.wait(seconds):
                raise _StopRequested

        try:
            return Retrying(**attempts.settings(backoff_sleep))(attempts.call, fn)
        except BaseException as exc:
            outcome = attempts.outcome(exc)
            if outcome is exc:
                raise
            raise outcome from attempts.cause(exc)

    async def run_async(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        stop_event: asyncio.Event | None = None,
        label: str = "handler",
    ) -> T:
        """run() for a coroutine function, on the event loop: the same attempts, backoffs and outcomes.

        The backoff is an asyncio sleep, cut short by `stop_event` (RetryInterrupted). Cancelling the
        awaiting task cancels the attempt or the backoff under way: CancelledError propagates unchanged,
        never counted as a failed attempt (the record is unfinished, not poison).
        """
        try:
            return await fn()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            first_error = exc
        attempts = _Attempts(self, label, first_error)

        async def backoff_sleep(seconds: float) -> None:
            if stop_event is None:
                await asyncio.sleep(seconds)
                return
            # asyncio.TimeoutError: on Python 3.10 wait_for raises it, and it is not yet the builtin
            # TimeoutError (3.11 made them one), so a backoff that ran out escaped as an error.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop_event.wait(), seconds)
                raise _StopRequested

        try:
            return await AsyncRetrying(**attempts.settings(backoff_sleep))(attempts.call_async, fn)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            outcome = attempts.outcome(exc)
            if outcome is exc:
                raise
            raise outcome from attempts.cause(exc)


class _Attempts:
    """One record's retrying after its first attempt failed: what run() and run_async() share (the tenacity
    settings, the count, the last error and what the ending means)."""

    def __init__(self, policy: RetryPolicy, label: str, first_error: BaseException) -> None:
        self._policy = policy
        self._label = label
        self._replay = [first_error]  # attempt 1 was made already: tenacity starts by replaying it
        self.made = 0
        self.last_error: BaseException | None = None

    def call(self, fn: Callable[[], T]) -> T:
        self.made += 1
        try:
            if self._replay:
                raise self._replay.pop()
            return fn()
        except BaseException as exc:
            self.last_error = exc
            raise

    async def call_async(self, fn: Callable[[], Awaitable[T]]) -> T:
        self.made += 1
        try:
            if self._replay:
                raise self._replay.pop()
            return await fn()
        except BaseException as exc:
            self.last_error = exc
            raise

    def settings(self, sleep: Callable[[float], Any]) -> dict[str, Any]:
        policy = self._policy

        def log_retry(state: RetryCallState) -> None:
            logger.warning(
                "%s failed on attempt %d/%d (%s: %s); retrying in %.2fs",
                self._label,
                state.attempt_number,
                policy.attempts,
                type(self.last_error).__name__,
                self.last_error,
                state.upcoming_sleep,
            )

        backoff = (wait_random_exponential if policy.jitter else wait_exponential)(
            multiplier=policy.initial_backoff_s, max=policy.max_backoff_s
        )
        return {"stop": stop_after_attempt(policy.attempts), "wait": backoff,
                "retry": retry_if_exception(policy._worth_retrying), "sleep": sleep, "before_sleep": log_retry}

    def outcome(self, exc: BaseException) -> BaseException:
        """What the retrying's ending `exc` means for the caller."""
        if isinstance(exc, _StopRequested):
            assert self.last_error is not None  # a backoff only ever follows a failed attempt
            return RetryInterrupted(self.last_error, self.made)
        if isinstance(exc, RetryError):
            error = exc.last_attempt.exception()
            assert error is not None  # tenacity only gives up after a failure
            return RetriesExhausted(error, self.made)
        if isinstance(exc, RetryInterrupted) or not isinstance(exc, Exception):
            return exc  # a stop request travelling outwards; KeyboardInterrupt, SystemExit: unchanged
        return RetriesExhausted(exc, self.made)  # not worth retrying: poison at once

    def cause(self, exc: BaseException) -> BaseException | None:
        """The error a translated outcome is chained to: the handler's last one."""
        if isinstance(exc, RetryError):
            return exc.last_attempt.exception()
        return self.last_error if isinstance(exc, _StopRequested) else exc


def retry_kafka_call(
    fn: Callable[[], T],
    *,
    deadline_s: float,
    what: str = "Kafka call",
    classify: Callable[[KafkaException], Disposition] = kafka_errors.classify,
    retry_on: Collection[Disposition] = (Disposition.RETRIABLE, Disposition.COORDINATOR),
    initial_backoff_s: float = 0.05,
    max_backoff_s: float = 1.0,
    log: logging.Logger = logger,
) -> T:
    """Call a confluent-kafka operation; retry while `classify` puts its KafkaException in `retry_on`.

    Backoff is exponential with full jitter, capped at `max_backoff_s` and at the time left before
    `deadline_s`. When the deadline has passed, the last KafkaException is re-raised unchanged, so the
    caller can classify it once more and wrap it (e.g. in CommitFailed). Any other exception, and a
    KafkaException of another disposition (fatal, rebalance, permanent, ...), is re-raised at once.
    The deadline bounds the retrying, not a single call: give each call its own timeout.
    """

    def worth_retrying(error: BaseException) -> bool:
        return isinstance(error, KafkaException) and classify(error) in retry_on

    backoff = wait_random_exponential(multiplier=initial_backoff_s, max=max_backoff_s)
    started = time.monotonic()

    def time_left() -> float:
        return max(0.0, deadline_s - (time.monotonic() - started))

    def wait_within_deadline(state: RetryCallState) -> float:
        # Never sleep past the deadline: the last attempt happens at the deadline, not after it.
        return min(backoff(state), time_left())

    def log_retry(state: RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, KafkaException):
            log.warning(
                "%s failed (%s, %s); retrying in %.2fs, %.1fs left",
                what,
                kafka_errors.describe(error),
                classify(error).value,
                state.upcoming_sleep,
                time_left(),
            )

    retrying = Retrying(
        stop=stop_after_delay(deadline_s),
        wait=wait_within_deadline,
        retry=retry_if_exception(worth_retrying),
        sleep=time.sleep,
        before_sleep=log_retry,
        reraise=True,
    )
    return retrying(fn)
