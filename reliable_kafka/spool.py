"""What the producer needs from a spool (the Spool protocol and the types it passes), and the in-memory
spool of durability mode `memory`.

The SQLite Outbox (reliable_kafka.outbox) survives a crash; MemorySpool does not, but it still bounds
the number of unconfirmed messages (send() blocks, then raises OutboxFull) and keeps them for re-sending
after an idempotent-producer fatal error, so no mode ever drops a message on its own. Both spools
implement this module's abstraction; it depends on neither.
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from reliable_kafka.errors import OutboxFull


class Durability(str, enum.Enum):
    """How much of a crash an appended message survives."""

    PROCESS = "process"  # WAL + synchronous=NORMAL: survives a crash of the process
    FSYNC = "fsync"  # WAL + synchronous=FULL: survives power loss
    MEMORY = "memory"  # no spool at all: MemorySpool; refused by Outbox


class NewMessage(NamedTuple):
    """A message to spool; `message_id` is its stable rk-id (see reliable_kafka.ids.new_id).

    A NamedTuple, not a dataclass: one is built per message on send's hot path, and a tuple is built
    about three times faster than a frozen dataclass.
    """

    message_id: str
    topic: str
    value: bytes | None
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()
    partition: int | None = None


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """A spooled message as stored: `state` is "pending" (to be sent) or "failed" (refused for good)."""

    seq: int
    message_id: str
    topic: str
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    partition: int | None
    state: str
    attempts: int
    last_error: str | None
    created_ms: int


@dataclass(frozen=True, slots=True)
class OutboxStats:
    """Counts for `reliable-kafka outbox status` and metrics; `file_bytes` includes the WAL file."""

    pending: int
    failed: int
    oldest_pending_age_s: float | None
    file_bytes: int
    max_messages: int


class Spool(Protocol):
    """The subset of Outbox the producer uses; both Outbox and MemorySpool provide it."""

    def append(self, messages: Sequence[NewMessage], *, timeout: float = 30.0) -> list[int]: ...
    def append_one(self, m: NewMessage, timeout: float = 30.0) -> int: ...
    def pending(self, *, after_seq: int = 0, limit: int | None = None) -> list[OutboxRow]: ...
    def get(self, seq: int) -> OutboxRow | None: ...
    def purge(self, *, state: str = "failed", seqs: Iterable[int] | None = None) -> int: ...
    def mark_delivered(self, seqs: Iterable[int]) -> None: ...
    def mark_failed(self, seq: int, reason: str) -> None: ...
    def record_attempt(self, seqs: Iterable[int], error: str) -> None: ...
    def failed(self, limit: int | None = None) -> list[OutboxRow]: ...
    def stats(self) -> OutboxStats: ...
    def close(self) -> None: ...


class MemorySpool:
    """Pending messages in a dict, in sequence order (durability mode `memory`).

    Messages are kept as given (no per-message copy or wrapper on the hot path: every object that lives
    until its delivery report is one more for the garbage collector to walk); the time a message was
    accepted is kept per batch, and rows are built only when someone asks for them (re-sends, inspection).
    """

    def __init__(self, max_messages: int = 1_000_000) -> None:
        self.max_messages = max_messages
        self._rows: dict[int, NewMessage] = {}  # seq -> message; seq order
        self._batch_firsts: list[int] = []  # the first seq of each appended batch (increasing) ...
        self._batch_ms: list[int] = []  # ... and when that batch was accepted
        self._attempts: dict[int, tuple[int, str]] = {}
        self._failed: dict[int, OutboxRow] = {}
        self._next_seq = 1
        self._cond = threading.Condition()

    def _created_ms(self, seq: int) -> int:
        return self._batch_ms[bisect.bisect_right(self._batch_firsts, seq) - 1]

    def _forget_old_batches(self) -> None:
        """Drop the times of batches that have no pending message left (now and then, not per call)."""
        if not self._rows:
            self._batch_firsts.clear()
            self._batch_ms.clear()
            return
        gone = bisect.bisect_right(self._batch_firsts, next(iter(self._rows))) - 1
        if gone >= 64:
            del self._batch_firsts[:gone]
            del self._batch_ms[:gone]

    def _row(self, seq: int, state: str = "pending", error: str | None = None) -> OutboxRow:
        m = self._rows[seq]
        attempts, last = self._attempts.get(seq, (0, None))
        return OutboxRow(seq, m.message_id, m.topic, m.key, m.value, m.headers, m.partition, state,
                         attempts, error if error is not None else last, self._created_ms(seq))

    def append(self, messages: Sequence[NewMessage], *, timeout: float = 30.0) -> list[int]:
        n = len(messages)
        if n > self.max_messages:
            raise OutboxFull(f"a batch of {n} messages is larger than the spool bound of {self.max_messages}")
        now_ms = time.time_ns() // 1_000_000
        with self._cond:
            deadline = time.monotonic() + timeout
            while len(self._rows) + n > self.max_messages:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise OutboxFull(
                        f"{len(self._rows)} messages are still unconfirmed (bound {self.max_messages}) after "
                        f"waiting {timeout:.1f}s; is the cluster reachable?"
                    )
                self._cond.wait(left)
            first = self._next_seq
            self._next_seq += n
            self._rows.update(zip(range(first, first + n), messages, strict=True))
            self._batch_firsts.append(first)
            self._batch_ms.append(now_ms)
            return list(range(first, first + n))

    def append_one(self, m: NewMessage, timeout: float = 30.0) -> int:
        """append() of one message; returns its seq."""
        return self.append((m,), timeout=timeout)[0]

    def pending(self, *, after_seq: int = 0, limit: int | None = None) -> list[OutboxRow]:
        with self._cond:
            rows = self._rows
            if not rows:
                return []
            out = []
            first = next(iter(rows))
            if after_seq < first:
                seqs: Iterable[int] = rows
            else:
                # Straight to after_seq by number, not by walking the dict from its oldest row: the
                # dispatcher asks for the rows past those it handed over, page by page, and a walk from
                # the start cost O(pending) a page. With hundreds of thousands pending (senders faster
                # than the brokers confirm) each page took tens of ms under the dispatcher's lock, which
                # every send takes.
                seqs = (seq for seq in range(after_seq + 1, self._next_seq) if seq in rows)
            for seq in seqs:
                if seq > after_seq:
                    out.append(self._row(seq))
                    if limit is not None and len(out) >= limit:
                        break
            return out

    def get(self, seq: int) -> OutboxRow | None:
        with self._cond:
            if seq in self._rows:
                return self._row(seq)
            return self._failed.get(seq)

    def purge(self, *, state: str = "failed", seqs: Iterable[int] | None = None) -> int:
        with self._cond:
            table: dict[int, Any] = self._failed if state == "failed" else self._rows
            chosen = list(table) if seqs is None else [s for s in seqs if s in table]
            for seq in chosen:
                del table[seq]
            self._forget_old_batches()
            self._cond.notify_all()
            return len(chosen)

    def mark_delivered(self, seqs: Iterable[int]) -> None:
        rows, attempts = self._rows, self._attempts
        with self._cond:
            for seq in seqs:
                rows.pop(seq, None)
                if attempts:
                    attempts.pop(seq, None)
            self._forget_old_batches()
            self._cond.notify_all()

    def mark_failed(self, seq: int, reason: str) -> None:
        with self._cond:
            if seq in self._rows:
                created = self._created_ms(seq)
                m = self._rows.pop(seq)
                attempts = self._attempts.get(seq, (0, None))[0] + 1
                self._failed[seq] = OutboxRow(seq, m.message_id, m.topic, m.key, m.value, m.headers, m.partition,
                                              "failed", attempts, reason, created)
                self._attempts.pop(seq, None)
            self._cond.notify_all()

    def record_attempt(self, seqs: Iterable[int], error: str) -> None:
        with self._cond:
            for seq in seqs:
                if seq in self._rows:
                    self._attempts[seq] = (self._attempts.get(seq, (0, None))[0] + 1, error)

    def failed(self, limit: int | None = None) -> list[OutboxRow]:
        with self._cond:
            rows = list(self._failed.values())
        return rows if limit is None else rows[:limit]

    def stats(self) -> OutboxStats:
        with self._cond:
            oldest = next(iter(self._rows), None)
            age = None if oldest is None else (time.time_ns() // 1_000_000 - self._created_ms(oldest)) / 1000
            return OutboxStats(len(self._rows), len(self._failed), age, 0, self.max_messages)

    def close(self) -> None:
        pass
