"""What the producer needs from a spool, and the in-memory spool of durability mode `memory`.

The SQLite Outbox survives a crash; MemorySpool does not, but it still bounds the number of
unconfirmed messages (send() blocks, then raises OutboxFull) and keeps them for re-sending after
an idempotent-producer fatal error, so no mode ever drops a message on its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from reliable_kafka.errors import OutboxFull
from reliable_kafka.outbox import NewMessage, OutboxRow, OutboxStats


class Spool(Protocol):
    """The subset of Outbox the producer uses; both Outbox and MemorySpool provide it."""

    def append(self, messages: Sequence[NewMessage], *, timeout: float = 30.0) -> list[int]: ...
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
    """Pending messages in a dict, in sequence order (durability mode `memory`)."""

    def __init__(self, max_messages: int = 1_000_000) -> None:
        self.max_messages = max_messages
        self._rows: dict[int, OutboxRow] = {}  # insertion order == seq order
        self._failed: dict[int, OutboxRow] = {}
        self._next_seq = 1
        self._cond = threading.Condition()

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
            seqs = []
            for m in messages:
                seq = self._next_seq
                self._next_seq += 1
                self._rows[seq] = OutboxRow(
                    seq, m.message_id, m.topic, m.key, m.value, m.headers, m.partition, "pending", 0, None, now_ms
                )
                seqs.append(seq)
            return seqs

    def pending(self, *, after_seq: int = 0, limit: int | None = None) -> list[OutboxRow]:
        with self._cond:
            out = []
            for seq, row in self._rows.items():
                if seq > after_seq:
                    out.append(row)
                    if limit is not None and len(out) >= limit:
                        break
            return out

    def get(self, seq: int) -> OutboxRow | None:
        with self._cond:
            return self._rows.get(seq) or self._failed.get(seq)

    def purge(self, *, state: str = "failed", seqs: Iterable[int] | None = None) -> int:
        with self._cond:
            table = self._failed if state == "failed" else self._rows
            chosen = list(table) if seqs is None else [s for s in seqs if s in table]
            for seq in chosen:
                del table[seq]
            self._cond.notify_all()
            return len(chosen)

    def mark_delivered(self, seqs: Iterable[int]) -> None:
        with self._cond:
            for seq in seqs:
                self._rows.pop(seq, None)
            self._cond.notify_all()

    def mark_failed(self, seq: int, reason: str) -> None:
        with self._cond:
            row = self._rows.pop(seq, None)
            if row is not None:
                self._failed[seq] = OutboxRow(
                    row.seq, row.message_id, row.topic, row.key, row.value, row.headers, row.partition,
                    "failed", row.attempts + 1, reason, row.created_ms,
                )
            self._cond.notify_all()

    def record_attempt(self, seqs: Iterable[int], error: str) -> None:
        with self._cond:
            for seq in seqs:
                row = self._rows.get(seq)
                if row is not None:
                    self._rows[seq] = OutboxRow(
                        row.seq, row.message_id, row.topic, row.key, row.value, row.headers, row.partition,
                        row.state, row.attempts + 1, error, row.created_ms,
                    )

    def failed(self, limit: int | None = None) -> list[OutboxRow]:
        with self._cond:
            rows = list(self._failed.values())
        return rows if limit is None else rows[:limit]

    def stats(self) -> OutboxStats:
        with self._cond:
            oldest = next(iter(self._rows.values()), None)
            age = (time.time_ns() // 1_000_000 - oldest.created_ms) / 1000 if oldest else None
            return OutboxStats(len(self._rows), len(self._failed), age, 0, self.max_messages)

    def close(self) -> None:
        pass
