"""RetryPolicy and retry_kafka_call: attempt counts, backoff bounds, give-up rules, stop requests."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from reliable_kafka.errors import ConfigError, RetriesExhausted, RetryInterrupted
from reliable_kafka.kafka_errors import Disposition
from reliable_kafka.retry import RetryPolicy, retry_kafka_call


class RecordingEvent(threading.Event):
    """A stop event that records each backoff the policy asks for, without sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout)
        return self.is_set()


class Flaky:
    """Fails with the given errors in turn, then returns 'ok'; counts calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def always(make: Callable[[], BaseException]) -> Flaky:
    return Flaky(*(make() for _ in range(1000)))


def test_success_on_the_first_attempt_does_not_wait() -> None:
    event = RecordingEvent()
    fn = Flaky()
    assert RetryPolicy().run(fn, stop_event=event) == "ok"
    assert fn.calls == 1
    assert event.waits == []


def test_transient_failures_are_retried_until_success() -> None:
    event = RecordingEvent()
    fn = Flaky(TimeoutError("db slow"), ConnectionError("reset"))
    assert RetryPolicy(attempts=3).run(fn, stop_event=event) == "ok"
    assert fn.calls == 3
    assert len(event.waits) == 2


def test_after_the_last_attempt_the_last_error_is_reported() -> None:
    event = RecordingEvent()
    errors = [RuntimeError(f"failure {i}") for i in range(5)]
    fn = Flaky(*errors)
    with pytest.raises(RetriesExhausted) as caught:
        RetryPolicy(attempts=4).run(fn, stop_event=event)
    assert caught.value.attempts == 4
    assert caught.value.last_error is errors[3]
    assert caught.value.__cause__ is errors[3]
    assert fn.calls == 4
    assert len(event.waits) == 3


def test_backoff_without_jitter_doubles_up_to_the_cap() -> None:
    event = RecordingEvent()
    policy = RetryPolicy(attempts=7, initial_backoff_s=0.5, max_backoff_s=3.0, jitter=False)
    with pytest.raises(RetriesExhausted):
        policy.run(always(lambda: ValueError("x")), stop_event=event)
    assert event.waits == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]


def test_full_jitter_stays_within_the_exponential_bound_and_varies() -> None:
    event = RecordingEvent()
    policy = RetryPolicy(attempts=61, initial_backoff_s=0.25, max_backoff_s=4.0, jitter=True)
    with pytest.raises(RetriesExhausted):
        policy.run(always(lambda: ValueError("x")), stop_event=event)
    waits = [w for w in event.waits if w is not None]
    assert len(waits) == 60
    for n, wait in enumerate(waits, start=1):
        assert 0.0 <= wait <= min(4.0, 0.25 * 2 ** (n - 1))
    capped = waits[10:]  # the window is [0, 4] from here on
    assert len({round(w, 6) for w in capped}) > 40  # random, not a fixed schedule
    assert min(capped) < 2.0 < max(capped)  # spread over the whole window, not pinned at the cap


def test_give_up_on_makes_the_record_poison_at_once() -> None:
    event = RecordingEvent()
    error = KeyError("no such customer")
    fn = Flaky(error)
    with pytest.raises(RetriesExhausted) as caught:
        RetryPolicy(give_up_on=(LookupError,)).run(fn, stop_event=event)
    assert caught.value.attempts == 1
    assert caught.value.last_error is error
    assert fn.calls == 1
    assert event.waits == []


def test_an_error_outside_retry_on_is_not_retried() -> None:
    fn = Flaky(ValueError("bad payload"))
    with pytest.raises(RetriesExhausted) as caught:
        RetryPolicy(retry_on=(TimeoutError,)).run(fn, stop_event=RecordingEvent())
    assert caught.value.attempts == 1
    assert fn.calls == 1


def test_retried_then_given_up_counts_every_attempt() -> None:
    fn = Flaky(TimeoutError("slow"), TimeoutError("slow"), ValueError("bad"))
    with pytest.raises(RetriesExhausted) as caught:
        RetryPolicy(retry_on=(TimeoutError,)).run(fn, stop_event=RecordingEvent())
    assert caught.value.attempts == 3
    assert isinstance(caught.value.last_error, ValueError)


def test_keyboard_interrupt_propagates_unchanged() -> None:
    fn = Flaky(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        RetryPolicy().run(fn, stop_event=RecordingEvent())
    assert fn.calls == 1


def test_a_stop_request_cuts_a_long_backoff_short_and_is_not_poison() -> None:
    stop = threading.Event()
    error = ConnectionError("downstream down")
    fn = always(lambda: error)
    timer = threading.Timer(0.1, stop.set)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(RetryInterrupted) as caught:
            RetryPolicy(initial_backoff_s=30.0, max_backoff_s=30.0, jitter=False).run(fn, stop_event=stop)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 10.0  # not the 30 s backoff
    assert not isinstance(caught.value, RetriesExhausted)
    assert caught.value.attempts == 1
    assert caught.value.last_error is error
    assert fn.calls == 1


def test_with_stop_already_requested_the_first_attempt_still_runs() -> None:
    stop = RecordingEvent()
    stop.set()
    assert RetryPolicy().run(Flaky(), stop_event=stop) == "ok"
    fn = Flaky(TimeoutError("slow"))
    with pytest.raises(RetryInterrupted):
        RetryPolicy().run(fn, stop_event=stop)
    assert fn.calls == 1


def test_a_stop_after_the_last_attempt_still_reports_exhaustion() -> None:
    stop = RecordingEvent()
    stop.set()
    with pytest.raises(RetriesExhausted):
        RetryPolicy(attempts=1).run(Flaky(TimeoutError("slow")), stop_event=stop)


def test_an_inner_stop_request_travels_outwards_untouched() -> None:
    inner = RetryInterrupted(TimeoutError("slow"), 2)
    fn = Flaky(inner)
    with pytest.raises(RetryInterrupted) as caught:
        RetryPolicy().run(fn, stop_event=RecordingEvent())
    assert caught.value is inner
    assert fn.calls == 1


def test_each_retry_is_logged_with_its_label(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="reliable_kafka.retry"):
        RetryPolicy(attempts=3).run(
            Flaky(TimeoutError("slow")), stop_event=RecordingEvent(), label="orders[3]@7"
        )
    assert len(caplog.records) == 1
    assert "orders[3]@7 failed on attempt 1/3 (TimeoutError: slow)" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"attempts": 0}, "attempts"),
        ({"initial_backoff_s": -1.0}, "initial_backoff_s"),
        ({"initial_backoff_s": 5.0, "max_backoff_s": 1.0}, "max_backoff_s"),
        ({"retry_on": (ValueError, "oops")}, "retry_on"),
        ({"give_up_on": (int,)}, "give_up_on"),
    ],
)
def test_invalid_policies_are_refused(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    assert caught.value.key == key


def test_an_error_with_a_broken_str_still_becomes_poison() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("broken __str__")

    error = Unprintable()
    with pytest.raises(RetriesExhausted) as caught:
        RetryPolicy(attempts=1).run(Flaky(error), stop_event=RecordingEvent())
    assert caught.value.last_error is error


# --- retry_kafka_call: infrastructure retries driven by the Kafka error classifier ---

FAST: dict[str, Any] = {"initial_backoff_s": 0.001, "max_backoff_s": 0.005}


def kafka_error(code: int, *, fatal: bool = False) -> KafkaException:
    return KafkaException(KafkaError(code, "synthetic", fatal=fatal))


@pytest.mark.parametrize(
    "code",
    [KafkaError._TRANSPORT, KafkaError.REQUEST_TIMED_OUT, KafkaError.NOT_COORDINATOR, KafkaError._WAIT_COORD],
)
def test_retriable_and_coordinator_errors_are_retried(code: int) -> None:
    fn = Flaky(kafka_error(code), kafka_error(code))
    assert retry_kafka_call(fn, deadline_s=10.0, **FAST) == "ok"
    assert fn.calls == 3


@pytest.mark.parametrize(
    "error",
    [
        kafka_error(KafkaError.TOPIC_AUTHORIZATION_FAILED),  # permanent
        kafka_error(KafkaError.UNKNOWN_MEMBER_ID),  # rebalance: drop staged offsets, do not retry
        kafka_error(KafkaError.PRODUCER_FENCED),  # fatal
        kafka_error(KafkaError._TRANSPORT, fatal=True),  # fatal flag wins over the code
        kafka_error(KafkaError._DESTROY),  # the client is closing: no later attempt can succeed
        RuntimeError("not a Kafka error"),
    ],
)
def test_other_errors_are_reraised_at_once_unchanged(error: BaseException) -> None:
    fn = Flaky(error)
    with pytest.raises(type(error)) as caught:
        retry_kafka_call(fn, deadline_s=10.0, **FAST)
    assert caught.value is error
    assert fn.calls == 1


def test_retry_on_chooses_which_dispositions_are_retried() -> None:
    fn = Flaky(kafka_error(KafkaError.UNKNOWN_MEMBER_ID))
    assert retry_kafka_call(fn, deadline_s=10.0, retry_on=(Disposition.REBALANCE,), **FAST) == "ok"
    assert fn.calls == 2
    fn = Flaky(kafka_error(KafkaError._TRANSPORT))
    with pytest.raises(KafkaException):
        retry_kafka_call(fn, deadline_s=10.0, retry_on=(Disposition.COORDINATOR,), **FAST)
    assert fn.calls == 1


def test_a_custom_classifier_is_asked() -> None:
    asked: list[int] = []

    def classify(exc: KafkaException) -> Disposition:
        asked.append(exc.args[0].code())
        return Disposition.RETRIABLE

    fn = Flaky(kafka_error(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    assert retry_kafka_call(fn, deadline_s=10.0, classify=classify, **FAST) == "ok"
    assert KafkaError.TOPIC_AUTHORIZATION_FAILED in asked


def test_the_deadline_ends_retrying_with_the_last_kafka_error() -> None:
    errors = [kafka_error(KafkaError.REQUEST_TIMED_OUT) for _ in range(10_000)]
    fn = Flaky(*errors)
    started = time.monotonic()
    with pytest.raises(KafkaException) as caught:
        retry_kafka_call(fn, deadline_s=0.5, initial_backoff_s=0.01, max_backoff_s=0.01)
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 5.0
    assert caught.value is errors[fn.calls - 1]
    # The backoff is capped at 10 ms (5 ms on average with full jitter): ~100 attempts fit into 0.5 s,
    # where an uncapped doubling backoff would fit about 7.
    assert fn.calls >= 15


def test_the_last_backoff_is_cut_to_the_deadline() -> None:
    fn = always(lambda: kafka_error(KafkaError._TRANSPORT))
    started = time.monotonic()
    with pytest.raises(KafkaException):
        retry_kafka_call(fn, deadline_s=0.2, initial_backoff_s=30.0, max_backoff_s=30.0)
    assert time.monotonic() - started < 5.0  # not a 30 s sleep
    # First call, then one more at the deadline; a wait can end a hair before the deadline it was cut to
    # (seen on a loaded host), which leaves a last sliver of backoff and one call more, never a 30 s sleep.
    assert fn.calls in (2, 3), fn.calls


def test_a_zero_deadline_means_one_attempt() -> None:
    fn = always(lambda: kafka_error(KafkaError._TRANSPORT))
    with pytest.raises(KafkaException):
        retry_kafka_call(fn, deadline_s=0.0, **FAST)
    assert fn.calls == 1


def test_kafka_retries_are_logged_with_the_broker_reason(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.commit")
    with caplog.at_level(logging.WARNING, logger="test.commit"):
        retry_kafka_call(
            Flaky(kafka_error(KafkaError.NOT_COORDINATOR)), deadline_s=5.0, what="commit", log=log, **FAST
        )
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message.startswith("commit failed (NOT_COORDINATOR")
    assert "coordinator" in message


def test_a_first_error_made_by_the_caller_counts_as_attempt_one() -> None:
    calls = []

    def fn() -> str:
        calls.append(1)
        raise TimeoutError("again")

    policy = RetryPolicy(attempts=3, initial_backoff_s=0.0, jitter=False)
    with pytest.raises(RetriesExhausted) as info:
        policy.run(fn, first_error=TimeoutError("first"))
    assert info.value.attempts == 3 and len(calls) == 2  # attempts 2 and 3 only

    assert policy.run(lambda: "ok", first_error=TimeoutError("first")) == "ok"


def test_a_first_error_not_worth_retrying_is_poison_without_another_call() -> None:
    called = []
    policy = RetryPolicy(attempts=5, give_up_on=(ValueError,))
    with pytest.raises(RetriesExhausted) as info:
        policy.run(lambda: called.append(1), first_error=ValueError("bad record"))
    assert info.value.attempts == 1 and not called
    with pytest.raises(KeyboardInterrupt):  # the process stopping is never retried nor wrapped
        RetryPolicy().run(lambda: None, first_error=KeyboardInterrupt())
