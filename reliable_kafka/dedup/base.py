"""The dedup store contract: claim a message key before the handler runs, confirm it after success.

A key is recorded as done only after its effect happened, so a failed handler never turns a redelivery
into a "duplicate" (the message would be lost); a store that cannot answer raises DedupStoreUnavailable.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypeVar, runtime_checkable

from reliable_kafka.errors import ConfigError

_Store = TypeVar("_Store", bound="DedupStore")

# How long both stores remember a confirmed key unless told otherwise (their `retention_s`); one
# constant, so that what measures them against hand-written code (`bench dedup`) keeps keys as long.
DEFAULT_RETENTION_S = 7 * 24 * 3600


@dataclass(frozen=True)
class ClaimResult:
    """How a batch of keys was answered; every distinct key of the batch is in exactly one set."""

    claimed: frozenset[str]
    """Reserved for this caller until the lease runs out: process these, then confirm or release them."""
    done: frozenset[str]
    """Confirmed earlier and still remembered: skip them, they are duplicates."""
    busy: frozenset[str]
    """Held by a live claim (another consumer's, or an earlier one of this store): try again later."""


@runtime_checkable
class DedupStore(Protocol):
    """Claim -> confirm/release dedup, in batches, one owner token per store instance.

    The flow for a batch of messages keyed by their `rk-id`:

    1. ``result = store.claim(keys, lease_s)``: skip ``result.done``, retry ``result.busy`` later;
    2. run the handler for ``result.claimed``;
    3. ``store.confirm(succeeded)`` and ``store.release(failed)``.

    If the process dies between 1 and 3, the claims expire after ``lease_s`` and anyone may claim the
    keys again, so the lease must be longer than the handler takes. If the handler succeeded but
    ``confirm`` could not be written, the effect can happen a second time after the lease expires; the
    inbox modes (``SQLiteDedupStore.inbox``, ``RedisDedupStore.inbox``) close that gap by committing an
    effect stored in the same store and the confirmation together.
    Every method raises ``DedupStoreUnavailable`` when the store cannot be read or written; the
    caller must then hold progress (fail closed): nothing is confirmed, nothing is committed.
    Subclasses get the context manager from here.
    """

    def claim(self, keys: Sequence[str], lease_s: float = 30.0) -> ClaimResult:
        """Try to reserve every key for ``lease_s`` seconds; one round trip for the whole batch."""
        ...

    def confirm(self, keys: Sequence[str]) -> None:
        """Record keys this store claimed as done for the retention window, even if their lease expired."""
        ...

    def release(self, keys: Sequence[str]) -> None:
        """Free this store's claims after a failed handler; never a done key or another owner's claim."""
        ...

    def close(self) -> None:
        """Release the store's connection; calling it twice is harmless."""
        ...

    def __enter__(self: _Store) -> _Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@dataclass(frozen=True)
class PartitionLease:
    """A consumer's hold on one partition of its group in a fenced store; a later `acquire` raises `epoch`."""

    group: str
    topic: str
    partition: int
    epoch: int

    @property
    def where(self) -> tuple[str, str, int]:
        return (self.group, self.topic, self.partition)


@runtime_checkable
class FencedDedupStore(DedupStore, Protocol):
    """A store that can also fence by partition: one write per record instead of a claim and a confirm.

    A consumer group gives each partition to one member at a time, so a per-key claim only guards
    against a member that lost its partitions without knowing it (a zombie: paused past its session).
    The fence guards against that once per partition instead:

    1. ``lease = store.acquire(group, topic, partition)`` when the partition is assigned (the newest
       acquirer wins: every acquire raises the epoch, so the previous holder's lease is lost);
    2. per batch, ``done, lost = store.seen(keys, leases)``: skip ``done``; a lost lease means the
       partition belongs to someone else: stop processing it;
    3. run the handler, then ``lost = store.record_done({lease: keys})``: ONE transaction checks that
       each lease is still this store's and records its keys as done; keys of a lost lease are not
       recorded (and their offsets must not be committed).

    The inbox of such a store refuses to commit (``PartitionFenced``) once a lease it holds was lost, so
    an effect written through it is applied by the partition's current owner only.
    """

    def acquire(self, group: str, topic: str, partition: int) -> PartitionLease:
        """Take the partition's lease for this store (one write); the previous holder's is lost."""
        ...

    def drop(self, leases: Iterable[PartitionLease]) -> None:
        """Forget leases locally (partition revoked, lost or fenced); writes nothing."""
        ...

    def seen(
        self, keys: Sequence[str], leases: Iterable[PartitionLease]
    ) -> tuple[frozenset[str], list[PartitionLease]]:
        """Which keys are done, and which of the leases are lost; reads only."""
        ...

    def record_done(self, keys: Mapping[PartitionLease, Sequence[str]]) -> list[PartitionLease]:
        """Record each live lease's keys as done in one transaction; returns the lost leases (not recorded)."""
        ...


def lost_leases(
    leases: Iterable[PartitionLease], holders: Mapping[tuple[str, str, int], tuple[str, int]], owner: str
) -> list[PartitionLease]:
    """The leases that are no longer `owner`'s, given each partition's current (holder, epoch).

    A lease is kept only while its partition's row names this owner at this very epoch: a later acquire
    (by anyone, this store included) has raised the epoch, and a missing row means it was never taken.
    """
    return [lease for lease in leases if holders.get(lease.where) != (owner, lease.epoch)]


def distinct_keys(keys: Sequence[str]) -> list[str]:
    """The batch without repeats, in first-seen order: a key repeated in one batch is one claim."""
    return list(dict.fromkeys(keys))


def lease_ms(lease_s: float) -> int:
    """A claim lease in whole milliseconds, refusing leases that would expire before the handler starts."""
    if not lease_s > 0:
        raise ConfigError("lease_s", f"must be a positive number of seconds, got {lease_s!r}")
    return max(1, round(lease_s * 1000))


def retention_ms(retention_s: float) -> int:
    """How long a confirmed key is remembered, in whole milliseconds."""
    if not retention_s > 0:
        raise ConfigError("retention_s", f"must be a positive number of seconds, got {retention_s!r}")
    return max(1, round(retention_s * 1000))
