"""Fetcher.step() with a full backlog: it waits for room before it pauses (a pause drops what librdkafka
prefetched), and pauses when the backlog stays full. Scripted parts, no Kafka."""

from __future__ import annotations

import itertools
import time
from typing import Any

from reliable_kafka.consumer.fetcher import Fetcher


class Backlog:
    """An OffsetTracker's in_flight(): full (10) for the first `full_for` looks, then 5."""

    def __init__(self, full_for: int | None) -> None:
        self.looks = itertools.count(1)
        self.full_for = full_for

    def in_flight(self) -> int:
        look = next(self.looks)
        return 10 if self.full_for is None or look <= self.full_for else 5


class Parts:
    """The client, rebalance handler and strategy: what the fetcher asked of each."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def consume(self, n: int, timeout: float) -> list[Any]:
        self.calls.append("consume")
        return []

    def pause_all(self) -> None:
        self.calls.append("pause_all")

    def resume_ours(self) -> None:
        self.calls.append("resume_ours")

    def handle_fetched(self, msgs: list[Any]) -> None:
        self.calls.append("handle_fetched")

    def handle(self, works: list[Any]) -> None:
        self.calls.append("handle")


def fetcher(backlog: Backlog, parts: Parts) -> Fetcher:
    return Fetcher(parts, backlog, parts, None, max_batch=10, max_in_flight=10)  # type: ignore[arg-type]


def test_a_full_backlog_that_drains_within_the_wait_is_not_paused() -> None:
    backlog, parts = Backlog(full_for=5), Parts()
    f = fetcher(backlog, parts)
    f.step(parts)  # type: ignore[arg-type]
    assert "pause_all" not in parts.calls and "consume" not in parts.calls
    f.step(parts)  # type: ignore[arg-type]  # room now: fetches as usual
    assert parts.calls == ["resume_ours", "consume", "handle_fetched"]


def test_a_backlog_that_stays_full_is_paused_after_the_wait_while_the_group_is_served() -> None:
    backlog, parts = Backlog(full_for=None), Parts()
    f = fetcher(backlog, parts)
    f.room_wait_s = 0.05
    started = time.monotonic()
    f.step(parts)  # type: ignore[arg-type]
    assert time.monotonic() - started >= 0.05
    assert parts.calls == ["pause_all", "consume"]  # paused, and consume() still serves rebalances
