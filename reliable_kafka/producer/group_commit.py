"""GroupCommit: concurrent single-message sends share one outbox transaction (flat combining).

Each message is accepted exactly when the one `accept()` call that carried it returned: its caller gets
that call's seq and error for it, or that call's exception (then nothing of the combined batch was stored).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from reliable_kafka.errors import ProducerClosed
from reliable_kafka.spool import NewMessage

log = logging.getLogger(__name__)

# accept(rows, errors) -> seqs: Dispatcher.accept's shape (errors is filled, seq -> reason).
Accept = Callable[[Sequence[NewMessage], dict[int, str]], list[int]]
# Called once per commit with every async ticket of that commit it owns, on the committing thread.
Waker = Callable[[list["Ticket"]], None]

# At most this many messages per combined commit: one transaction stays short (a caller waits for at
# most one batch ahead of it per hand-on), and the producer caps it at its outbox bound as well, so a
# combined batch never asks for more room than the outbox has in all.
MAX_BATCH = 1_000


class Ticket:
    """One submitted message and, once its commit ran, its outcome: `seq` and `error`, or `exc`."""

    __slots__ = ("row", "waker", "token", "seq", "error", "exc", "done")

    def __init__(self, row: NewMessage, waker: Waker | None = None, token: Any = None) -> None:
        self.row = row
        self.waker = waker  # None for a sync ticket: its caller waits on the condition
        self.token = token  # the async caller's handle (an asyncio future, say): GroupCommit never reads it
        self.seq = 0
        self.error: str | None = None  # Kafka refused it at once (it is kept in the outbox as failed)
        self.exc: BaseException | None = None  # accept() raised: nothing of its batch was stored
        self.done = False


class GroupCommit:
    """Coalesces concurrent submissions into one `accept()` call each, in submission order.

    Sync callers (`submit`) use leader/follower: a caller that finds no commit in progress leads, and
    commits the oldest queued tickets (its own among them) inline on its own thread; callers that arrive
    meanwhile queue and wait, and when the leader is done one of them leads the next batch. A leader
    commits one batch and hands on, so under sustained load no caller serves others for long, and each
    caller waits at most for the batches queued ahead of it (FIFO, at most `max_batch` each).

    Async callers (`submit_async`) never wait here: their ticket carries a waker, called once per commit
    with all of that commit's tickets it owns. When no sync caller is leading, a writer thread (started
    on the first async submission, stopped by close()) leads for them.
    """

    def __init__(self, accept: Accept, *, max_batch: int = MAX_BATCH, name: str = "reliable-kafka-group-commit"
                 ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._accept = accept
        self._max_batch = max_batch
        self._name = name
        self._lock = threading.Lock()
        self._followers = threading.Condition(self._lock)  # sync callers waiting for their ticket or a turn
        self._writer_wake = threading.Condition(self._lock)  # the writer thread, waiting for async tickets
        self._queue: deque[Ticket] = deque()
        self._leading = False  # a commit is in progress (its leader owns the batch it took)
        self._waiting = 0  # sync followers in wait(): no notify_all when there are none
        self._writer: threading.Thread | None = None
        self._closed = False

    # ---- sync callers ----------------------------------------------------------------------

    def submit(self, row: NewMessage) -> tuple[int, str | None]:
        """Accept one message on the caller's thread, combined with whatever else is queued.

        Returns (seq, error) once its commit returned; raises that commit's exception.
        """
        lock = self._lock
        lock.acquire()
        if not self._leading and not self._queue and not self._closed:
            # Nobody is committing and nobody waits: commit alone, inline, without a ticket. This is the
            # single-threaded send() path: no thread hand-off, no queue, two lock round trips.
            self._leading = True
            lock.release()
            errors: dict[int, str] = {}
            try:
                seq = self._accept((row,), errors)[0]
            finally:
                self._hand_on(())
            return seq, errors.get(seq) if errors else None
        lock.release()
        ticket = Ticket(row)
        with lock:
            self._enqueue(ticket)
        return self._follow(ticket)

    def _follow(self, ticket: Ticket) -> tuple[int, str | None]:
        """Wait for a queued sync ticket, leading whenever no one else does.

        A leader commits the oldest queued tickets, which hold its own unless more than max_batch were
        queued ahead of it: then it commits those, and leads again only if no one else took over.
        """
        while True:
            with self._lock:
                while not ticket.done and self._leading:
                    self._waiting += 1
                    try:
                        self._followers.wait()
                    finally:
                        self._waiting -= 1
                if ticket.done:
                    break
                batch = self._take()
            self._commit(batch)
            if ticket.done:
                break
        return self._outcome(ticket)

    @staticmethod
    def _outcome(ticket: Ticket) -> tuple[int, str | None]:
        if ticket.exc is not None:
            raise ticket.exc
        return ticket.seq, ticket.error

    # ---- async callers ---------------------------------------------------------------------

    def submit_async(self, row: NewMessage, waker: Waker, token: Any) -> Ticket:
        """Queue one message without waiting; `waker` is called with its ticket once its commit ran.

        The waker runs on the committing thread (a sync leader's or the writer's) and must only hand
        the tickets over (e.g. loop.call_soon_threadsafe), never block or raise.
        """
        ticket = Ticket(row, waker, token)
        with self._lock:
            self._enqueue(ticket)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name=self._name, daemon=True)
                self._writer.start()
            elif not self._leading:
                self._writer_wake.notify()
        return ticket

    def _write_loop(self) -> None:
        """The writer thread: lead for queued tickets whenever no one else leads, until close()."""
        while True:
            with self._lock:
                while (self._leading or not self._queue) and not (self._closed and not self._queue):
                    self._writer_wake.wait()
                if not self._queue:
                    return  # closed and drained
                batch = self._take()
            self._commit(batch)

    @property
    def queued(self) -> int:
        """Submissions waiting for a commit (not counting the one in progress)."""
        return len(self._queue)

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self, timeout: float | None = 30.0) -> None:
        """Refuse new submissions (ProducerClosed), let the writer commit what is queued, stop it."""
        with self._lock:
            self._closed = True
            self._writer_wake.notify()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)
            if writer.is_alive():
                log.warning("group-commit writer still committing after %ss; it ends with its batch", timeout)

    # ---- the commit, under leadership --------------------------------------------------------

    def _enqueue(self, ticket: Ticket) -> None:
        """(Lock held.) Queue a ticket, or refuse it after close()."""
        if self._closed:
            raise ProducerClosed("send after close(): create a new producer")
        self._queue.append(ticket)

    def _take(self) -> list[Ticket]:
        """(Lock held, no one leading.) Become the leader of the oldest queued tickets."""
        self._leading = True
        queue, n = self._queue, min(len(self._queue), self._max_batch)
        return [queue.popleft() for _ in range(n)]

    def _commit(self, batch: list[Ticket]) -> None:
        """One accept() for the batch: one outbox transaction, so every ticket shares its outcome."""
        try:
            errors: dict[int, str] = {}
            try:
                seqs = self._accept([t.row for t in batch], errors)
            except BaseException as exc:  # noqa: BLE001 - every caller of the batch gets it, and nothing was stored
                for t in batch:
                    t.exc = exc
            else:
                for t, seq in zip(batch, seqs, strict=True):
                    t.seq = seq
                    if errors:
                        t.error = errors.get(seq)
        finally:
            self._hand_on(batch)
        wakers: dict[Waker, list[Ticket]] = {}
        for t in batch:
            if t.waker is not None:
                wakers.setdefault(t.waker, []).append(t)
        for waker, tickets in wakers.items():
            try:
                waker(tickets)
            except Exception:  # a waker of a closed event loop: its callers are gone, the rest are not
                log.exception("could not wake %d async sender(s) after their commit", len(tickets))

    def _hand_on(self, batch: Sequence[Ticket]) -> None:
        """Mark the batch done and give up leadership: a waiting caller or the writer leads next."""
        with self._lock:
            for t in batch:
                t.done = True
            self._leading = False
            if self._waiting:
                self._followers.notify_all()
            if self._queue and self._writer is not None:
                self._writer_wake.notify()
