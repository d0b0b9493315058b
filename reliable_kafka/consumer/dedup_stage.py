"""Dedup stage: claims each record's key in a dedup store before its handler runs and confirms it after.

Guarantee: effect, then dedup record, then offset; while the store is down (fail closed, the default)
nothing past the waiting records runs, is confirmed or is committed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Message

from reliable_kafka.consumer.work import Work
from reliable_kafka.dedup.base import DedupStore
from reliable_kafka.errors import ConfigError, DedupStoreUnavailable
from reliable_kafka.ids import message_id_of
from reliable_kafka.stats import Counters

log = logging.getLogger(__name__)

KeyFunction = Callable[[Message], "str | None"]


def rk_id_of(msg: Message) -> str | None:
    """The default dedup key: the record's rk-id header (None for records of other producers)."""
    return message_id_of(msg.headers())  # type: ignore[arg-type]


@dataclass(frozen=True)
class DedupPolicy:
    """Run each record once per key: `store` holds the keys, `key` gives a record's key (default: its
    rk-id), a claim holds for `lease_s`, and `fail_open=True` processes without dedup while the store
    is down (duplicates possible) instead of holding progress."""

    store: DedupStore
    key: KeyFunction | None = None  # None: the rk-id header
    lease_s: float = 60.0
    fail_open: bool = False

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


class DedupStage:
    """The store calls of a dedup consumer: claim a batch, confirm what was handled, release the rest."""

    def __init__(self, policy: DedupPolicy, counters: Counters) -> None:
        self._store = policy.store
        self.key_of: KeyFunction = policy.key or rk_id_of
        self._lease_s = policy.lease_s
        self.fail_open = policy.fail_open
        self._counters = counters
        self._lock = threading.Lock()  # workers add to _to_confirm while the loop confirms
        self._to_confirm: list[Work] = []  # handled records whose key still needs confirming
        self._retries = 0  # failed store calls in the current outage (counts["store_retries"])
        self._down_since: float | None = None  # a fail-closed outage started then
        if policy.fail_open:
            log.warning("dedup_fail_open=True: while the dedup store is down, duplicates are processed again")

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
        order.
        """
        keys = [self.key_of(w.msg) for w in works]
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

    def confirm_later(self, works: list[Work]) -> None:
        """Handled records with a claimed key: confirmed by the next confirmed() (any thread)."""
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

    def release(self, works: list[Work]) -> None:
        """Free the claims of records that did not finish, so their redelivery runs without waiting."""
        keys = [w.key for w in works if w.key is not None]
        if keys:
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
