"""Counters of a consumer's outcomes (handled, dead_lettered, commits, ...), shared by its parts.

Guarantee: increments from worker threads are never lost (one lock), and a read is a consistent copy.
"""

from __future__ import annotations

import threading


class Counters:
    """Named counts. Thread-safe; the hot path adds once per batch, so the lock costs nothing there."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = value

    def get(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
