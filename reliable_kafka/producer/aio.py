"""AsyncReliableProducer: the asyncio front end of ReliableProducer, with the same guarantee.

`await send()` returns once the message is durable in the outbox (per the durability mode), exactly as the
sync send() returns; nothing that can block (an outbox commit, a preflight, flush, close) runs on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from reliable_kafka.errors import ProducerClosed, WrongEventLoop
from reliable_kafka.producer.front import ReliableProducer
from reliable_kafka.producer.group_commit import GroupCommit, Ticket
from reliable_kafka.producer.messages import Headers, Message, Sent
from reliable_kafka.serdes import UserSerializer
from reliable_kafka.spool import Durability, MemorySpool, NewMessage, OutboxRow
from reliable_kafka.stats import Stats

# Dispatcher.accept_now's shape: the seqs, or None (nothing stored) where accept() would wait.
AcceptNow = Callable[[Sequence[NewMessage], dict[int, str]], list[int] | None]


def _resolve(tickets: list[Ticket]) -> None:
    """(On the loop.) Hand each committed ticket's outcome to the send() awaiting it."""
    for t in tickets:
        future: asyncio.Future[tuple[int, str | None]] = t.token
        if future.done():
            continue  # its send() was cancelled; the message itself was accepted (or refused) all the same
        if t.exc is not None:
            future.set_exception(t.exc)
        else:
            future.set_result((t.seq, t.error))


class _LoopCommit:
    """Memory mode's group commit on the event loop itself, for the sends of one loop pass.

    Each send() queues its row here and awaits its future; the first of a pass schedules commit(), which
    runs once the pass's other tasks have queued theirs: one Dispatcher.accept_now() for all of them on
    the loop (the memory spool is a dict and librdkafka's produce() does not block), each future then
    resolved in place. Where accept_now declines (it would wait for room in librdkafka or the spool, or
    for the dispatcher's lock; nothing was stored), the rows go to the writer thread, whose accept may
    wait, with the same futures: no message is lost or accepted twice.

    Why: the writer's hand-over cost a thread hop, a ticket and a lock per message and a wake-up of the
    loop per commit; and a one-message accept per send on the loop cost more CPU than the writer's
    batches (no broker, 200 tasks x 500 sends: 32 us per send on the loop against 25 us for loop and
    writer together), where one accept per pass costs 16-18 us. On a 3-node cluster (200 tasks, 300k
    messages) the sending process spent 22-30 us per message against 30-32 us through the writer, and
    1M messages ran at 1.13x and 1.35x AIOProducer in two runs (docs/results.md, "One send() per request").
    """

    __slots__ = ("_loop", "_accept_now", "_group", "_wake", "_rows", "_futures")

    def __init__(self, loop: asyncio.AbstractEventLoop, accept_now: AcceptNow, group: GroupCommit,
                 wake: Callable[[list[Ticket]], None]) -> None:
        self._loop = loop
        self._accept_now = accept_now
        self._group = group
        self._wake = wake
        self._rows: list[NewMessage] = []
        self._futures: list[asyncio.Future[tuple[int, str | None]]] = []

    def submit(self, row: NewMessage) -> asyncio.Future[tuple[int, str | None]]:
        """Queue one row for this pass's commit; the future gets its (seq, error) or the commit's exception."""
        future: asyncio.Future[tuple[int, str | None]] = self._loop.create_future()
        if not self._rows:
            self._loop.call_soon(self.commit)
        self._rows.append(row)
        self._futures.append(future)
        return future

    def commit(self) -> None:
        """(On the loop.) Accept what is queued, or hand it to the writer where accepting would wait."""
        rows, futures = self._rows, self._futures
        if not rows:
            return
        self._rows, self._futures = [], []
        errors: dict[int, str] = {}
        try:
            seqs = self._accept_now(rows, errors)
        except Exception as exc:  # noqa: BLE001 - every send of the commit raises it, as the writer's do
            for f in futures:
                if not f.done():
                    f.set_exception(exc)
            return
        if seqs is None:
            for row, f in zip(rows, futures, strict=True):
                try:
                    self._group.submit_async(row, self._wake, f)
                except ProducerClosed as exc:
                    if not f.done():
                        f.set_exception(exc)
            return
        for f, seq in zip(futures, seqs, strict=True):
            if not f.done():  # its send() was cancelled; the message itself was accepted all the same
                f.set_result((seq, errors.get(seq) if errors else None))


class AsyncReliableProducer:
    """A Kafka producer for asyncio that does not lose accepted messages.

    Takes the same arguments as ReliableProducer (`config`, `outbox_path=`, `durability=`, `max_pending=`,
    `send_timeout_s=`, `preflight=`, serializers, `on_failed=`, ...) and composes one: the outbox, the
    dispatcher and the group commit are that producer's, so both front ends keep the same promises.

    Concurrent `await send()` calls share outbox transactions (group commit): a writer thread commits
    whatever is queued in one transaction and wakes the loop once per commit (in memory mode, whose
    accept does no I/O, the sends of one loop pass are accepted together on the loop while that cannot
    wait: _LoopCommit). The first send to a topic
    (its preflight, and a Schema Registry serializer's first request for the topic's subject), send_many(),
    flush(), wait()'s first look, start() and close() run on the producer's own worker threads. Serializers
    otherwise run on the loop, as in aiokafka: keep them quick.

    Bound to the event loop of its first start() (or send()): calls from another loop raise WrongEventLoop.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        *,
        outbox_path: str | os.PathLike[str] | None = None,
        outbox_dir: str | os.PathLike[str] | None = None,
        durability: Durability | str = Durability.PROCESS,
        max_pending: int = 1_000_000,
        max_in_flight: int = 20_000,
        send_timeout_s: float = 30.0,
        preflight: str = "error",
        value_serializer: UserSerializer | None = None,
        key_serializer: UserSerializer | None = None,
        on_failed: Callable[[OutboxRow], None] | None = None,
    ) -> None:
        """The arguments mean what they mean for ReliableProducer (one vocabulary for both front ends)."""
        # The constructor opens the outbox file (a short SQLite open and lock), as ReliableProducer's does.
        self._sync = ReliableProducer(
            config, outbox_path=outbox_path, outbox_dir=outbox_dir, durability=durability, max_pending=max_pending,
            max_in_flight=max_in_flight, send_timeout_s=send_timeout_s, preflight=preflight,
            value_serializer=value_serializer, key_serializer=key_serializer, on_failed=on_failed)
        self._group = self._sync._group
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Future[Any] | None = None
        self._closed = False
        # Slow calls run here, not in the loop's default executor, so they cannot starve the application's.
        self._workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="reliable-kafka-aio")
        self._waiters: dict[int, list[asyncio.Future[str]]] = {}  # seq -> wait() calls (touched on the loop)
        # One object for every ticket: GroupCommit calls each distinct waker once per commit.
        self._wake = self._wake_loop
        # Memory mode's accept does no I/O: its sends are committed on the loop (_LoopCommit) whenever that
        # cannot wait, and only otherwise through the writer thread.
        self._accept_now = self._sync._dispatcher.accept_now if isinstance(self._sync._spool, MemorySpool) else None
        self._loop_commit: _LoopCommit | None = None

    @property
    def sync(self) -> ReliableProducer:
        """The ReliableProducer underneath, for inspection (failed(), state(), forget_failed()): its calls
        read the outbox on the calling thread, so from async code run them with asyncio.to_thread()."""
        return self._sync

    # ---- lifecycle ---------------------------------------------------------------------------

    def _bound_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, after checking it is this producer's and the producer is open."""
        loop = asyncio.get_running_loop()
        if self._closed:
            raise ProducerClosed("send after close(): create a new AsyncReliableProducer")
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise WrongEventLoop(f"this AsyncReliableProducer started on event loop {self._loop!r} and was called "
                                 f"from {loop!r}; use it from the loop it started on (or one producer per loop)")
        return loop

    async def start(self) -> AsyncReliableProducer:
        """Start delivering (idempotent; concurrent calls share one start): what an earlier run left in
        the outbox goes out first. `async with` and the first send() call it for you."""
        loop = self._bound_loop()
        if self._starting is None:
            self._sync._dispatcher.set_listener(self._on_settled)
            self._starting = loop.run_in_executor(self._workers, self._sync.start)  # reads the outbox
        await asyncio.shield(self._starting)
        return self

    async def close(self, timeout: float | None = 30.0) -> int:
        """Stop accepting, deliver what is pending within `timeout`, release the outbox (off the loop).

        Returns how many are still pending (in the outbox modes they stay there for the next start).
        Pending wait() calls return "pending". A second close() does nothing.
        """
        if self._closed:
            return 0
        loop = self._bound_loop()
        self._closed = True
        if self._loop_commit is not None:
            self._loop_commit.commit()  # sends made before close() are accepted, as the writer's queue is
        if self._starting is not None:
            # A failed start was raised to its caller; close() still releases what it opened.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._starting)
        try:
            return await loop.run_in_executor(self._workers, self._sync.close, timeout)
        finally:
            self._sync._dispatcher.set_listener(None)
            waiters, self._waiters = self._waiters, {}
            for futures in waiters.values():
                for f in futures:
                    if not f.done():
                        f.set_result("pending")
            self._workers.shutdown(wait=False)

    async def __aenter__(self) -> AsyncReliableProducer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- sending -------------------------------------------------------------------------------

    async def send(
        self,
        topic: str,
        value: Any,
        key: Any = None,
        headers: Headers = None,
        partition: int | None = None,
        *,
        message_id: str | None = None,
    ) -> Sent:
        """Accept one message; returns once it is durable per the durability mode.

        Raises what ReliableProducer.send() raises: OutboxFull, TopicConfigError, SerializationError,
        DeliveryFailed (refused at once; kept as failed), ProducerClosed; and WrongEventLoop. If the
        awaiting task is cancelled the message may still have been accepted: it is then delivered.
        """
        loop = self._bound_loop()
        if self._starting is None or not self._starting.done():
            await self.start()
        sync = self._sync
        if type(topic) is str and topic in sync._seen_topics:
            row = sync._prepare_call(topic, value, key, headers, partition, message_id)  # serializing only: no I/O
        else:
            # The topic's first send: its preflight asks the cluster (up to ~5 s).
            row = await loop.run_in_executor(self._workers, sync._prepare_one,
                                             Message(topic, value, key, headers, partition, message_id))
        if self._accept_now is not None:
            if self._loop_commit is None:
                self._loop_commit = _LoopCommit(loop, self._accept_now, self._group, self._wake)
            seq, error = await self._loop_commit.submit(row)
            return sync._sent_one(row, seq, error)
        outcome: asyncio.Future[tuple[int, str | None]] = loop.create_future()
        self._group.submit_async(row, self._wake, outcome)
        seq, error = await outcome
        return sync._sent_one(row, seq, error)

    async def send_many(self, messages: Iterable[Message | tuple[str, Any]]) -> list[Sent]:
        """Accept a batch in one outbox transaction (off the loop); a Sent per message, in order."""
        loop = self._bound_loop()
        if self._starting is None or not self._starting.done():
            await self.start()
        batch = list(messages)
        return await loop.run_in_executor(self._workers, self._sync.send_many, batch)

    def _wake_loop(self, tickets: list[Ticket]) -> None:
        """(On the committing thread.) One hand-over to the loop per commit, whatever its size."""
        assert self._loop is not None  # a ticket is only queued by send(), after the loop is bound
        self._loop.call_soon_threadsafe(_resolve, tickets)

    # ---- waiting -------------------------------------------------------------------------------

    async def flush(self, timeout: float | None = None) -> int:
        """Wait (off the loop) until every accepted message is delivered or failed, or `timeout`;
        returns how many are still pending."""
        loop = self._bound_loop()
        return await loop.run_in_executor(self._workers, self._sync.flush, timeout)

    async def wait(self, sent: Sent, timeout: float | None = None) -> str:
        """Wait until one message is delivered or failed (or `timeout`); returns "pending", "delivered"
        or "failed". Resolved from the poller's delivery reports: no thread or outbox query per waiter
        beyond one first look at its state."""
        loop = self._bound_loop()
        if self._starting is None or not self._starting.done():
            await self.start()
        settled: asyncio.Future[str] = loop.create_future()
        # Registered before the first look: a report that lands in between resolves it, and one that
        # landed before is what the look sees (the spool is updated before the listener runs).
        self._waiters.setdefault(sent.seq, []).append(settled)
        try:
            state = await loop.run_in_executor(self._workers, self._sync.state, sent)
            if state != "pending":
                return state
            await asyncio.wait((settled,), timeout=timeout)
            return settled.result() if settled.done() else "pending"
        finally:
            futures = self._waiters.get(sent.seq)
            if futures is not None:
                if settled in futures:
                    futures.remove(settled)
                if not futures:
                    del self._waiters[sent.seq]

    async def delivered(self, sent: Sent) -> str:
        """Wait until one message is settled; returns "delivered" or "failed" ("pending" if the producer
        was closed first)."""
        return await self.wait(sent, None)

    def _on_settled(self, delivered: list[int], failed: list[int]) -> None:
        """(Dispatcher's listener, on the poller thread, once per poll round.) Resolve waiters on the loop."""
        loop = self._loop
        if self._waiters and loop is not None:
            # RuntimeError: the loop was closed under a running producer, and nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._settle, delivered, failed)

    def _settle(self, delivered: list[int], failed: list[int]) -> None:
        waiters = self._waiters
        for seqs, state in ((delivered, "delivered"), (failed, "failed")):
            for seq in seqs:
                futures = waiters.pop(seq, None)
                if futures is not None:
                    for f in futures:
                        if not f.done():
                            f.set_result(state)

    # ---- inspecting ----------------------------------------------------------------------------

    def stats(self) -> Stats:
        """What this producer did so far (ReliableProducer.stats(): in memory, no I/O)."""
        return self._sync.stats()

    @property
    def in_flight(self) -> int:
        """Messages librdkafka holds now."""
        return self._sync.in_flight
