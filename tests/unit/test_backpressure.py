"""produce_when_room(): a full local queue is waited out (serving delivery reports), never a dropped message."""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer

from reliable_kafka.backpressure import produce_when_room


class _FullFor:
    """A producer whose queue is full for the first `full` calls; records what it was asked to do."""

    def __init__(self, full: int, error: Exception | None = None) -> None:
        self.full = full
        self.error = error
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self.polls: list[float] = []

    def produce(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))
        if self.error is not None:
            raise self.error
        if len(self.calls) <= self.full:
            raise BufferError("Local: Queue full")

    def poll(self, timeout: float) -> int:
        self.polls.append(timeout)
        return 0


def test_retries_with_the_same_arguments_serving_reports_in_between() -> None:
    p = _FullFor(full=3)
    assert produce_when_room(p, "t", b"v", None, -1, None, None, 0, [("rk-id", b"1")], poll_s=0.01)  # type: ignore[arg-type]
    assert p.calls == [(("t", b"v", None, -1, None, None, 0, [("rk-id", b"1")]), {})] * 4
    assert p.polls == [0.01] * 3


def test_keywords_pass_through() -> None:
    p = _FullFor(full=0)
    assert produce_when_room(p, "t", b"v", headers={"rk-id": b"1"})  # type: ignore[arg-type]
    assert p.calls == [(("t", b"v"), {"headers": {"rk-id": b"1"}})]
    assert p.polls == []


def test_other_errors_pass_through_at_once() -> None:
    p = _FullFor(full=0, error=KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)))
    with pytest.raises(KafkaException):
        produce_when_room(p, "t", b"v")  # type: ignore[arg-type]
    assert len(p.calls) == 1


def test_a_queue_that_stays_full_gives_up_after_the_timeout() -> None:
    # A real librdkafka producer with room for one message and no broker to send it to.
    p = Producer({"bootstrap.servers": "127.0.0.1:1", "queue.buffering.max.messages": 1, "log_level": 0})
    try:
        assert produce_when_room(p, "t", b"first", timeout_s=0.2)
        started = time.monotonic()
        assert not produce_when_room(p, "t", b"second", timeout_s=0.2, poll_s=0.02)
        assert 0.2 <= time.monotonic() - started < 2.0
        assert len(p) == 1
    finally:
        p.purge()
