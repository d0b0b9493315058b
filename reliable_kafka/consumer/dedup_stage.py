"""Dedup stage: skips records whose key is done, and records the keys of handled records before their offsets.

Guarantee: effect, then dedup record, then offset; while the store is down (fail closed, the default)
nothing past the waiting records runs, is recorded or is committed. Two ways to keep a key from running
twice at once: per-key claims, or (one record at a time, a store that can) the partition fence.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Message

from reliable_kafka.consumer.work import Work
from reliable_kafka.dedup.base import DedupStore, FencedDedupStore, PartitionLease
from reliable_kafka.errors import ConfigError, DedupStoreUnavailable, PartitionFenced
from reliable_kafka.ids import message_id_of
from reliable_kafka.stats import Counters

log = logging.getLogger(__name__)

KeyFunction = Callable[[Message], "str | None"]
Partitions = set[tuple[str, int]]


def rk_id_of(msg: Message) -> str | None:
    """The default dedup key: the record's rk-id header (None for records of other producers)."""
    return message_id_of(msg.headers())  # type: ignore[arg-type]


@dataclass(frozen=True)
class DedupPolicy:
    """Run each record once per key: `store` holds the keys, `key` gives a record's key (default: its
    rk-id), a claim holds for `lease_s`, and `fail_open=True` processes without dedup while the store
    is down (duplicates possible) instead of holding progress.

    `fence=True` (the default) fences by partition when the store can (SQLiteDedupStore) and the consumer
    runs one record at a time (concurrency=1, not the asyncio front end): one lease per partition taken
    on assignment and one write per batch, instead of a claim and a confirm per key. `fence=False` keeps
    per-key claims: needed when programs outside this consumer group run the same keys at the same time
    against the same store (the fence excludes only this group's zombies)."""

    store: DedupStore
    key: KeyFunction | None = None  # None: the rk-id header
    lease_s: float = 60.0
    fail_open: bool = False
    fence: bool = True

    def __post_init__(self) -> None:
        if self.store is None:
            raise ConfigError("DedupPolicy.store", "needs a DedupStore (SQLiteDedupStore, RedisDedupStore); "
                                                   "for a consumer without dedup pass dedup=None")
        if self.lease_s <= 0:
            raise ConfigError("DedupPolicy.lease_s", f"must be positive, got {self.lease_s}")


@dataclass
class Claimed:
    """One claim call's verdict on a batch, each list in delivery order."""

    run: list[Work]  # claimed now (key set), or without a key: run these
    later: list[Work]  # behind a busy key on their partition: claim again on the next pass
    duplicates: list[Work]  # key confirmed earlier, or a copy of a key that runs in this batch
    fenced: list[Work] = field(default_factory=list)  # of a partition another consumer holds: never run


def fenced_verdict(works: list[Work], keys: list[str | None], done: frozenset[str], shut: Partitions) -> Claimed:
    """How a batch runs under the partition fence (no claims): records of a partition that is shut (its
    lease is another consumer's) never run; of the rest, a done key or a second copy in the batch is a
    duplicate, anything else runs (with its key set, to be recorded after the handler)."""
    verdict = Claimed([], [], [])
    running: set[str] = set()
    for w, key in zip(works, keys, strict=True):
        if shut and (w.msg.topic(), w.msg.partition()) in shut:
            verdict.fenced.append(w)
        elif key is None:
            verdict.run.append(w)
        elif key in done or key in running:
            verdict.duplicates.append(w)
        else:
            w.key = key
            running.add(key)
            verdict.run.append(w)
    return verdict


class DedupStage:
    """The store calls of a dedup consumer: claim (or check) a batch, record what was handled, release the rest.

    `choose_mode()` picks, per run, between per-key claims and the partition fence; `on_fenced` is told
    which partitions another consumer took over (the rebalance handler drops and pauses them).
    """

    def __init__(self, policy: DedupPolicy, counters: Counters, group: str = "") -> None:
        self._store = policy.store
        self.key_of: KeyFunction = policy.key or rk_id_of
        self._lease_s = policy.lease_s
        self.fail_open = policy.fail_open
        self._counters = counters
        self._lock = threading.Lock()  # workers add to _to_confirm while the loop confirms
        self._to_confirm: list[Work] = []  # handled records whose key still needs confirming
        self._retries = 0  # failed store calls in the current outage (counts["store_retries"])
        self._down_since: float | None = None  # a fail-closed outage started then
        self._group = group
        # The same store, typed for the fence; None when it cannot fence or the policy says no.
        self._fence_store = policy.store if policy.fence and isinstance(policy.store, FencedDedupStore) else None
        self.fenced = False  # this run fences by partition (choose_mode)
        self._leases: dict[tuple[str, int], PartitionLease] = {}  # partitions whose lease we took
        # Partitions not ours until assigned again (taken over, revoked or lost): their records neither run
        # nor reach _record(), whose leases they no longer have.
        self.shut: Partitions = set()
        self.on_fenced: Callable[[Partitions], None] = lambda partitions: None
        if policy.fail_open:
            log.warning("dedup_fail_open=True: while the dedup store is down, duplicates are processed again")

    def choose_mode(self, *, exclusive: bool) -> None:
        """Fence by partition when the policy and the store allow it and records of a partition run one
        at a time on this thread (`exclusive`): a key's copy in the next batch is then checked only after
        the earlier one was recorded. Otherwise (worker threads, event-loop lanes) keys are claimed."""
        self.fenced = self._fence_store is not None and exclusive
        log.info("dedup by %s", "partition fence (one write per record)" if self.fenced else "per-key claims")

    @property
    def store_up(self) -> bool:
        """False during a fail-closed outage: partitions stay paused until the store is back."""
        return self._down_since is None

    def retry_in_s(self) -> float:
        """How long a batch waits, paused, before its claim is tried again (grows during an outage)."""
        return min(2.0, 0.1 * 2 ** min(5, self._retries))

    def claim(self, works: list[Work]) -> Claimed | None:
        """Claim the batch's keys in one store call; None when the store is unavailable.

        A busy key (another consumer's live claim, or a dead one's until its lease expires) holds back
        its record and every later record of its partition, so each partition still runs in offset
        order. Under the fence there are no claims: done keys are read, the batch's partitions' leases
        taken (once) and checked.
        """
        keys = [self.key_of(w.msg) for w in works]
        if self.fenced:
            return self._check(works, keys)
        try:
            result = self._store.claim([k for k in keys if k is not None], self._lease_s)
        except DedupStoreUnavailable as exc:
            self._outage(exc)
            return None
        self._back()
        done, claimed = result.done, result.claimed
        verdict = Claimed([], [], [])
        running: set[str] = set()
        blocked: set[tuple[str | None, int | None]] = set()  # partitions behind a busy record
        for w, key in zip(works, keys, strict=True):
            if blocked and (w.msg.topic(), w.msg.partition()) in blocked:
                verdict.later.append(w)
            elif key is None:
                verdict.run.append(w)
            elif key in done or key in running:
                verdict.duplicates.append(w)
            elif key in claimed:
                w.key = key
                running.add(key)
                verdict.run.append(w)
            else:
                blocked.add((w.msg.topic(), w.msg.partition()))
                verdict.later.append(w)
        if len(running) < len(claimed):
            # Claimed, but every record of the key waits behind a busy one: free it for the next claim.
            with contextlib.suppress(DedupStoreUnavailable):  # else the lease expires on its own
                self._store.release(list(claimed - running))
        return verdict

    def _check(self, works: list[Work], keys: list[str | None]) -> Claimed | None:
        store = self._fence_store
        assert store is not None  # choose_mode() fences only with one
        msgs = [w.msg for w in works]
        partitions: Partitions = set(zip(map(Message.topic, msgs), map(Message.partition, msgs), strict=True))  # type: ignore[arg-type]
        try:
            for tp in partitions - self.shut - self._leases.keys():
                # First batch of a partition since it was assigned: the newest holder wins, so from
                # here on a zombie's batch of it can no longer be recorded (nor its inbox commit).
                self._leases[tp] = store.acquire(self._group, *tp)
            leases = [self._leases[tp] for tp in partitions if tp in self._leases]
            done, lost = store.seen([k for k in keys if k is not None], leases)
        except DedupStoreUnavailable as exc:
            self._outage(exc)
            return None
        self._back()
        if lost:
            self.lose(lost)
        verdict = fenced_verdict(works, keys, done, self.shut)
        if verdict.fenced:
            # Prefetched records of a shut partition: dropped with it again, never run nor committed.
            self.on_fenced({(w.msg.topic(), w.msg.partition()) for w in verdict.fenced})  # type: ignore[misc]
        return verdict

    def lose(self, leases: list[PartitionLease]) -> None:
        """Another consumer took these partitions' leases: shut them until the group assigns them again."""
        partitions = {(lease.topic, lease.partition) for lease in leases}
        for lease in leases:
            if self._leases.get((lease.topic, lease.partition)) == lease:
                del self._leases[(lease.topic, lease.partition)]
        if self._fence_store is not None:
            self._fence_store.drop(leases)
        with self._lock:
            self._to_confirm = [w for w in self._to_confirm if (w.msg.topic(), w.msg.partition()) not in partitions]
        self.shut |= partitions
        log.error("dedup lease of %s taken over by another consumer of group %r: this consumer lost them "
                  "(paused or cut off past session.timeout.ms?); their handled records are not recorded and "
                  "their offsets not committed, the new owner processes them", sorted(partitions), self._group)
        self.on_fenced(partitions)

    def fenced_out(self, w: Work, exc: PartitionFenced) -> bool:
        """A handler's inbox refused with PartitionFenced: shut the partitions it names. Returns True when
        `w` is to run again (its own partition is still ours: the refusal was about another one)."""
        named = set(exc.partitions)
        leases = [lease for tp, lease in self._leases.items() if tp in named]
        if leases:
            self.lose(leases)
        self.shut |= named  # named but dropped already (by an earlier refusal): stays shut
        return (w.msg.topic(), w.msg.partition()) not in named

    def assigned(self, partitions: Partitions) -> None:
        """The group assigned these partitions (again): their lease is taken with their next batch."""
        self.shut -= partitions

    def forget(self, partitions: Partitions) -> None:
        """Revoked or lost partitions: their leases go (a revoke recorded their keys first)."""
        if self.fenced:
            self.shut |= partitions
        gone = [self._leases.pop(tp) for tp in partitions if tp in self._leases]
        if gone and self._fence_store is not None:
            self._fence_store.drop(gone)
            with self._lock:
                self._to_confirm = [w for w in self._to_confirm
                                    if (w.msg.topic(), w.msg.partition()) not in partitions]

    def confirm_later(self, works: list[Work]) -> None:
        """Handled records with a claimed key: confirmed by the next confirmed() (any thread)."""
        if self.shut and self.fenced:
            # Handled before their partition was taken over (earlier in the same batch): not ours to record.
            shut = self.shut
            works = [w for w in works if (w.msg.topic(), w.msg.partition()) not in shut]
        with self._lock:
            self._to_confirm.extend(works)

    def confirmed(self) -> list[Work]:
        """Confirm the handled records' keys in one store call; returns the records whose offsets may
        now be committed (none while a fail-closed outage lasts; all when failing open).

        Effect, then dedup record, then offset: a crash in between redelivers the record, whose key is
        then done (skipped) or its claim expires and it runs again (inbox mode closes that gap).
        """
        with self._lock:
            pending, self._to_confirm = self._to_confirm, []
        if not pending:
            return []
        try:
            if self.fenced:
                return self._record(pending)
            self._store.confirm([w.key for w in pending if w.key is not None])
        except DedupStoreUnavailable as exc:
            self._outage(exc)
            if not self.fail_open:
                with self._lock:
                    self._to_confirm = pending + self._to_confirm
                return []
            # Fail open: the effect happened; unconfirmed, a redelivery of the record may run again.
        else:
            self._back()
        return pending

    def _record(self, pending: list[Work]) -> list[Work]:
        """One transaction: check each partition's lease, record its keys as done; what may be committed.

        A pending record's partition has a lease: records run only after _check() took it, forget() /
        lose() drop a partition's pending records with its lease, and confirm_later() keeps out those of
        a partition shut meanwhile. Should one come without a lease all the same, it is neither recorded
        nor committed (its partition is not ours).
        """
        store = self._fence_store
        assert store is not None
        by_lease: dict[PartitionLease, list[str]]
        unleased = False
        if len(self._leases) == 1:  # one partition held: the lot in one step, no per-record lookup
            by_lease = {next(iter(self._leases.values())): [w.key for w in pending]}  # type: ignore[misc]
        else:
            by_tp: dict[tuple[str, int], list[str]] = defaultdict(list)
            for w in pending:
                by_tp[(w.msg.topic(), w.msg.partition())].append(w.key)  # type: ignore[index,arg-type]
            by_lease = {self._leases[tp]: keys for tp, keys in by_tp.items() if tp in self._leases}
            unleased = len(by_lease) < len(by_tp)
        lost = store.record_done(by_lease)
        self._back()
        if not lost and not unleased:
            return pending
        if lost:
            self.lose(lost)
        live = {(lease.topic, lease.partition) for lease in by_lease if lease not in lost}
        return [w for w in pending if (w.msg.topic(), w.msg.partition()) in live]

    def release(self, works: list[Work]) -> None:
        """Free the claims of records that did not finish, so their redelivery runs without waiting."""
        keys = [w.key for w in works if w.key is not None]
        if keys and not self.fenced:  # the fence holds no per-key claims
            with contextlib.suppress(DedupStoreUnavailable):  # the leases expire on their own
                self._store.release(keys)

    def _outage(self, exc: Exception) -> None:
        """A store call failed: one log line per outage (not per retry), then count the retry."""
        if not self._retries:
            self._counters.add("store_outages")
            if self.fail_open:
                log.warning("dedup store unavailable (%s); dedup_fail_open=True: processing without dedup until "
                            "it is back, duplicates are processed again", exc)
            else:
                self._down_since = time.monotonic()
                log.error("dedup store unavailable (%s); holding progress, nothing is committed until it is back",
                          exc)
        self._retries += 1
        self._counters.set("store_retries", self._retries)

    def _back(self) -> None:
        """A store call succeeded: end the outage, if there was one, and let partitions resume."""
        if self._retries:
            since, self._down_since = self._down_since, None
            took = "" if since is None else f" after {time.monotonic() - since:.1f} s"
            log.warning("dedup store is back%s; resuming with dedup", took)
            self._retries = 0
            self._counters.set("store_retries", 0)
