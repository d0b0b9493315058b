"""GroupCommit: concurrent single-message sends share one outbox transaction (flat combining).

Each message is accepted exactly when the one `accept()` call that carried it returned: its caller gets
that call's seq and error for it, or that call's exception (then nothing of the combined batch was stored).
"""

from __future__ import annotations

import logging
import threading
import time
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

    __slots__ = ("row", "waker", "token", "gate", "seq", "error", "exc", "done")

    def __init__(self, row: NewMessage, waker: Waker | None = None, token: Any = None) -> None:
        self.row = row
        self.waker = waker  # None for a sync ticket: its caller waits on `gate`
        self.token = token  # the async caller's handle (an asyncio future, say): GroupCommit never reads it
        # A sync caller's own wake-up: held from submission until its commit ran or it is asked to lead.
        self.gate: threading.Lock | None = None
        self.seq = 0
        self.error: str | None = None  # Kafka refused it at once (it is kept in the outbox as failed)
        self.exc: BaseException | None = None  # accept() raised: nothing of its batch was stored
        self.done = False


class GroupCommit:
    """Coalesces concurrent submissions into one `accept()` call each, in submission order.

    Sync callers (`submit`) use leader/follower: a caller that finds no commit in progress leads, and
    commits the oldest queued tickets (its own among them) inline on its own thread; callers that arrive
    meanwhile queue and wait. A leader commits one batch and hands on, so under sustained load no caller
    serves others for long, and each caller waits at most for the batches queued ahead of it (FIFO, at
    most `max_batch` each).

    Each waiting caller sleeps on its own gate (a lock), and a commit wakes exactly the callers it
    settled plus the owner of the oldest queued ticket, whom it makes the next leader. Waking every
    waiter on each commit (one condition) cost 16 sending threads a wake-up each per commit, though only
    the few it settled could go on: each of those wake-ups is a GIL hand-over, and they made 16 threads
    no faster than one.

    A caller that finds no commit in progress and nothing queued commits at once, unless the callers the
    last commit settled are expected back: then it waits for them, at most as long as that commit took,
    and commits with them (see _gather). Without that, from 16 threads in durability "fsync", the first
    caller back after a commit committed alone while the others queued behind it: every other commit
    carried one message, each an fsync.

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
        self._writer_wake = threading.Condition(self._lock)  # the writer thread, waiting for async tickets
        self._queue: deque[Ticket] = deque()
        # A commit is in progress, or a queued sync caller was made the next leader and is waking up: either
        # way no one else may start one (a sync ticket is only ever queued while this is true).
        self._leading = False
        self._successor: Ticket | None = None  # the queued sync ticket whose caller was made the next leader
        # The sync callers the last commit settled that have not submitted again (any submission counts),
        # how long after it a caller may wait for them, and whether one does (on `_gathered`).
        self._expected = 0
        self._gather_until = 0.0
        self._gathering = False
        self._gathered = threading.Condition(self._lock)
        self._last_commit_s = 0.0
        self._writer: threading.Thread | None = None
        self._closed = False

    # ---- sync callers ----------------------------------------------------------------------

    def submit(self, row: NewMessage) -> tuple[int, str | None]:
        """Accept one message on the caller's thread, combined with whatever else is queued.

        Returns (seq, error) once its commit returned; raises that commit's exception.
        """
        lock = self._lock
        lock.acquire()
        if self._closed:
            lock.release()
            raise ProducerClosed("send after close(): create a new producer")
        if self._expected:
            self._expected -= 1
            if not self._expected and self._gathering:
                self._gathered.notify()
        gather = False
        if not self._leading and not self._queue:
            if not self._expected or time.monotonic() >= self._gather_until:
                # Nobody is committing, nobody waits and nobody is expected: commit alone, inline, without
                # a ticket. This is the single-threaded send() path: no thread hand-off, no queue, two
                # lock round trips.
                self._leading = True
                lock.release()
                return self._commit_alone(row)
            gather = True
        ticket = Ticket(row)
        gate = ticket.gate = threading.Lock()
        gate.acquire()  # held until a commit settles the ticket or makes its caller the next leader
        self._queue.append(ticket)
        waiting = self._leading
        self._leading = True  # a no-op when waiting; otherwise only async tickets wait, and this caller leads
        if gather:
            self._successor = ticket  # so that _abandon() passes leadership on if it is interrupted
        lock.release()
        try:
            if waiting:
                gate.acquire()
            elif gather:
                with lock:
                    self._gather()
            while not ticket.done:
                # (Leading.) The oldest queued tickets: its own among them unless more than max_batch were
                # queued ahead of it; then it waits again, for its commit or for its turn to lead.
                with lock:
                    self._successor = None
                    batch = self._take()
                self._commit(batch)
                if not ticket.done:
                    gate.acquire()
        except BaseException:
            self._abandon(ticket)  # interrupted while waiting (KeyboardInterrupt): others must go on
            raise
        if ticket.exc is not None:
            raise ticket.exc
        return ticket.seq, ticket.error

    def _gather(self) -> None:
        """(Lock held, leading, the caller's ticket queued.) Wait for the callers the last commit settled to
        submit again (they queue behind this caller), or until as long as that commit took has passed since
        it ended; then this caller commits them all at once.

        Why bounded by the last commit's duration: waiting costs a lone caller at most one more commit's
        time, and a caller whose thread does other work before it sends again is not waited for longer.
        """
        self._gathering = True
        try:
            while self._expected:
                remaining = self._gather_until - time.monotonic()
                if remaining <= 0:
                    break
                self._gathered.wait(remaining)
        finally:
            self._gathering = False
            self._expected = 0  # whoever comes later joins a later commit

    def _commit_alone(self, row: NewMessage) -> tuple[int, str | None]:
        """(Leading, nothing queued.) One message's commit on the caller's thread, without a ticket."""
        errors: dict[int, str] = {}
        started = time.monotonic()
        try:
            seq = self._accept((row,), errors)[0]
        finally:
            self._last_commit_s = time.monotonic() - started
            self._hand_on((), callers=1)
        return seq, errors.get(seq) if errors else None

    def _abandon(self, ticket: Ticket) -> None:
        """Take back a sync ticket whose caller stopped waiting: not stored if no commit took it yet, and
        leadership passed on if it had been handed to this caller."""
        with self._lock:
            if ticket.done:
                return
            if ticket in self._queue:
                self._queue.remove(ticket)
            designated = self._successor is ticket
            if designated:
                self._successor = None
        if designated:
            self._hand_on(())

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
                self._leading = True
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
        """(Lock held, leading.) The oldest queued tickets, for one commit."""
        queue, n = self._queue, min(len(self._queue), self._max_batch)
        return [queue.popleft() for _ in range(n)]

    def _commit(self, batch: list[Ticket]) -> None:
        """One accept() for the batch: one outbox transaction, so every ticket shares its outcome."""
        started = time.monotonic()
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
            self._last_commit_s = time.monotonic() - started
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

    def _hand_on(self, batch: Sequence[Ticket], *, callers: int = 0) -> None:
        """Mark the batch done, wake its sync callers, and pass leadership on: to the owner of the oldest
        queued ticket when it is a sync caller, else to the writer (async tickets), else to no one.

        `callers`: sync callers the commit settled without a ticket (_commit_alone); they and the batch's
        sync callers are expected back (_gather)."""
        with self._lock:
            for t in batch:
                t.done = True
                if t.gate is not None:
                    callers += 1
            if callers:
                self._expected = callers
                self._gather_until = time.monotonic() + self._last_commit_s
            queue = self._queue
            head = queue[0] if queue else None
            if head is not None and head.gate is not None:
                self._successor = head  # still leading: its caller takes the next batch when it wakes
            else:
                self._leading = False
                if head is not None and self._writer is not None:
                    self._writer_wake.notify()
        for t in batch:
            if t.gate is not None:
                t.gate.release()
        if head is not None and head.gate is not None:
            head.gate.release()
