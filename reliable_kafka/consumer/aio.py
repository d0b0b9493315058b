"""AsyncReliableConsumer: the asyncio front end of ReliableConsumer, with the same guarantee.

An offset is committed only when it and every earlier offset of its partition were processed; librdkafka's
consume(), commit() and close() run on the consumer's own thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from confluent_kafka import Message

from reliable_kafka import telemetry
from reliable_kafka.consumer.commits import CommitPolicy
from reliable_kafka.consumer.dedup_stage import DedupPolicy
from reliable_kafka.consumer.front import _DEAD_LETTER_TOPIC, ReliableConsumer
from reliable_kafka.consumer.strategies import ClaimedStrategy, LoopStrategy
from reliable_kafka.consumer.work import AsyncHandler, Work
from reliable_kafka.dlq import DeadLetterPolicy
from reliable_kafka.errors import ClientClosed, DeserializationError, InputRefused, WrongEventLoop
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.serdes import UserDeserializer
from reliable_kafka.stats import Stats


class AsyncReliableConsumer:
    """A consumer group member for asyncio that never commits past unprocessed work.

    Takes ReliableConsumer's arguments and composes one: the fetcher, the commit coordinator (and its
    offset tracker), the rebalance handler, the failure stages (retry → dead letter) and the dedup stage
    are that consumer's, so both front ends keep the same promises. Two ways to use it:

      * `await run(handler)` with `async def handler(msg)`: retries (RetryPolicy, asyncio backoffs),
        dead-letter topic, dedup; up to `concurrency` handlers at once, records of one key (without a
        key: of one partition) one after the other, in offset order.
      * `async for msg in consumer:` — a record counts as processed when the loop body finishes and asks
        for the next one (a `break` or an exception leaves it unprocessed: it is delivered again).

    The client lives on one thread of its own ("reliable-kafka-consumer"): it fetches, serves rebalances
    and commits there and hands each fetched batch to the loop in one call. Dead-letter writes and dedup
    calls run on a second small pool. Bound to the event loop of its first call (WrongEventLoop otherwise).
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        dead_letter: DeadLetterPolicy | None = _DEAD_LETTER_TOPIC,
        concurrency: int = 1,
        max_in_flight: int = 2_000,
        max_batch: int = 500,
        commit: CommitPolicy | None = None,
        dedup: DedupPolicy | None = None,
        revoke_timeout_s: float = 30.0,
        value_deserializer: UserDeserializer | None = None,
        key_deserializer: UserDeserializer | None = None,
    ) -> None:
        """The arguments mean what they mean for ReliableConsumer (one vocabulary for both front ends);
        `concurrency` is the number of handlers awaited at once. The constructor creates the librdkafka
        handle (no I/O), as ReliableConsumer's does."""
        self._sync = ReliableConsumer(
            config, topics, retry=retry, dead_letter=dead_letter, concurrency=concurrency,
            max_in_flight=max_in_flight, max_batch=max_batch, commit=commit, dedup=dedup,
            revoke_timeout_s=revoke_timeout_s, value_deserializer=value_deserializer,
            key_deserializer=key_deserializer)
        self.topics = self._sync.topics
        self._concurrency = concurrency
        self._max_batch = max_batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Future[Any] | None = None
        self._closed = False
        self._stopping = asyncio.Event()  # cuts retry backoffs short on the loop (the sync side has its own)
        # Every call on the librdkafka handle runs on this one thread: consume(), rebalance callbacks,
        # commits, close(). run() occupies it for its whole duration; close() queues behind it.
        self._client_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reliable-kafka-consumer")
        # What may block besides the client: dead-letter writes (they wait for the acknowledgement), dedup calls.
        self._blocking = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reliable-kafka-aio")
        self._buffer: deque[Work] = deque()  # fetched for `async for`, not yet handed out
        self._running = False  # run() holds the client's thread

    @property
    def sync(self) -> ReliableConsumer:
        """The ReliableConsumer underneath, for inspection (assignment, dedup_key_of())."""
        return self._sync

    # ---- lifecycle ---------------------------------------------------------------------------

    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise ClientClosed("this AsyncReliableConsumer was closed; create a new one")
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise WrongEventLoop(f"this AsyncReliableConsumer started on event loop {self._loop!r} and was called "
                                 f"from {loop!r}; use it from the loop it started on (or one consumer per loop)")
        return loop

    async def start(self) -> AsyncReliableConsumer:
        """Subscribe (idempotent; on the client's thread). `async with`, run() and `async for` call it."""
        loop = self._bound_loop()
        if self._starting is None:
            self._starting = loop.run_in_executor(self._client_thread, self._sync.start)
        await asyncio.shield(self._starting)
        return self

    def stop(self) -> None:
        """Ask run() (or `async for`) to finish: stop fetching, let in-flight handlers finish (up to
        `revoke_timeout_s`), commit what finished, return. Safe from a signal handler and any thread."""
        self._sync.stop()  # the fetch loop's flag (a threading.Event)
        loop = self._loop
        if loop is None or loop.is_closed():
            self._stopping.set()
        else:
            with contextlib.suppress(RuntimeError):  # the loop is shutting down: nothing waits on it
                loop.call_soon_threadsafe(self._stopping.set)

    async def close(self, timeout: float = 30.0) -> None:
        """Commit what was processed, leave the group (revoked partitions are committed first) and close the
        dead-letter producer, off the loop; waits for a run() still stopping first. A second call does nothing."""
        if self._closed:
            return
        loop = self._bound_loop()
        self._closed = True
        self.stop()
        try:
            await loop.run_in_executor(self._client_thread, self._sync.close, timeout)
        finally:
            self._client_thread.shutdown(wait=False)
            self._blocking.shutdown(wait=False)

    async def __aenter__(self) -> AsyncReliableConsumer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- handler API ---------------------------------------------------------------------------

    async def run(self, handler: AsyncHandler, *, stop_after: float | None = None) -> None:
        """Consume until stop(), cancellation (or `stop_after` seconds), awaiting `handler(msg)` per record.

        A handler that raises is retried by the RetryPolicy; a record that still fails goes to the
        dead-letter topic, and its offset is committed only after that write is acknowledged. On stop()
        or cancellation, fetching stops, handlers in flight may finish within `revoke_timeout_s`, what
        finished is committed; a handler still running then is cancelled and its record is not committed.
        A cancelled run() raises CancelledError once that is done.
        """
        loop = self._bound_loop()
        await self.start()
        sync = self._sync
        if sync._decoding is not None:
            handler = sync._decoding.async_handler(handler)
        if sync._metrics:  # decided once: without an SDK no record pays for the timing
            handler = telemetry.timed_async_handler(handler, sync._group)
        offload = functools.partial(loop.run_in_executor, self._blocking)
        lanes = LoopStrategy(handler, self._concurrency, loop, self._stopping, offload,
                             fetcher=sync._fetcher, failures=sync._failures, commits=sync._commits,
                             stop_consumer=self.stop)
        strategy: LoopStrategy | ClaimedStrategy = lanes
        if sync._dedup is not None:
            # Lanes run on the loop while the next batch is checked: a key's copy there could run beside
            # the earlier one, which only a per-key claim stops.
            sync._dedup.choose_mode(exclusive=False)
            strategy = ClaimedStrategy(lanes, sync._dedup, bare=False, fetcher=sync._fetcher,
                                       failures=sync._failures, commits=sync._commits, counters=sync._counters)
        if self._running:
            raise InputRefused("run() is already running on this consumer: one run() per consumer")
        self._running = True
        lanes.start()
        deadline = None if stop_after is None else time.monotonic() + stop_after
        serving = loop.run_in_executor(self._client_thread, sync._serve, strategy, deadline)
        try:
            await asyncio.shield(serving)
        except asyncio.CancelledError:
            # Graceful stop, then the cancellation goes on: _serve() waits for the handlers in flight
            # (they keep running on this loop meanwhile) and commits what finished.
            self.stop()
            with contextlib.suppress(Exception):
                await asyncio.shield(serving)
            raise
        finally:
            await lanes.cancel()
            self._running = False
        if lanes.failed is not None:
            raise lanes.failed

    # ---- explicit API --------------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._records()

    async def _records(self) -> AsyncIterator[Message]:
        """Records until stop(); each is processed (committable) once the loop body asks for the next."""
        loop = self._bound_loop()
        await self.start()
        sync = self._sync
        stop, buffer, commits = sync._stop, self._buffer, sync._commits
        while not stop.is_set():
            if not buffer:
                buffer.extend(await loop.run_in_executor(self._client_thread, self._fetch))
                continue
            w = buffer.popleft()
            if sync._decoding is not None:
                try:
                    sync._decoding.decode(w.msg)
                except DeserializationError as exc:
                    exc.record = w.msg  # still in flight: ack() it once you parked it somewhere
                    raise
            yield w.msg
            commits.done(w)  # the body finished with it: processed

    def _fetch(self) -> list[Work]:
        """(On the client's thread.) A batch for `async for`, tracked; and a commit if one is due."""
        sync = self._sync
        msgs = sync._fetcher.fetch(self._max_batch, 0.5)
        works = [sync._fetcher.work(m) for m in msgs]
        sync._commits.confirm_handled()
        sync._commits.maybe_commit()
        return works

    def ack(self, msg: Message) -> None:
        """Mark a record processed that `async for` could not hand out as processed (a DeserializationError's
        `record`, once you parked it somewhere); the loop body's records are marked for you."""
        self._sync.ack(msg)

    async def commit(self, partitions: Sequence[tuple[str, int]] | None = None) -> dict[tuple[str, int], int]:
        """Commit what is processed (of `partitions`, or all) now, synchronously, on the client's thread.

        For `async for` and after run(): run() commits by itself (CommitPolicy, revokes, stop) and holds
        the client's thread, so a commit() while it runs raises InputRefused instead of waiting for it.
        """
        loop = self._bound_loop()
        if self._running:
            raise InputRefused("commit() while run() runs: run() commits by itself (as the CommitPolicy says, "
                               "on revoke and when it stops); call commit() with `async for` or after run()")
        return await loop.run_in_executor(self._client_thread, self._sync.commit, partitions)

    # ---- inspecting ----------------------------------------------------------------------------

    def stats(self) -> Stats:
        """What this consumer did so far (ReliableConsumer.stats(): in memory, no I/O)."""
        return self._sync.stats()

    @property
    def assignment(self) -> list[tuple[str, int]]:
        """The (topic, partition) pairs held now, as the rebalance callbacks reported them (no librdkafka call:
        one from the loop would wait while the client's thread is in consume())."""
        return self._sync._rebalance.held
