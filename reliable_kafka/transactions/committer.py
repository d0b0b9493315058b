"""The committer thread: runs the processor's commits in order, off the consume loop's thread.

Guarantee: commits run one at a time in submission order, and a commit still stuck inside librdkafka never
holds up the process's exit (a daemon thread).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class Committer:
    """One daemon thread that runs commits in order.

    Not a ThreadPoolExecutor: its threads are joined when the interpreter exits, so a commit that a stop
    gave up on, still waiting inside librdkafka on a hung coordinator, would hold up the process's exit.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread with the future
                future.set_exception(exc)

    def shutdown(self, timeout: float) -> None:
        """Let queued commits finish, then end the thread; wait up to `timeout` for that."""
        self._queue.put(None)
        self._thread.join(timeout)
