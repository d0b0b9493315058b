"""SQLite dedup store: claim/confirm/release semantics, leases, retention, several processes, inbox atomicity,
and the partition fence (a later acquire shuts the earlier holder out of recording and of its inbox).

DedupStoreContract is the behaviour every DedupStore must show; the Redis tests run it on a real server.
"""

from __future__ import annotations

import logging
import multiprocessing
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from reliable_kafka.dedup import ClaimResult, DedupStore, PartitionLease, SQLiteDedupStore
from reliable_kafka.dedup.base import lost_leases
from reliable_kafka.dedup.sqlite import LEGACY_TABLE, TABLE
from reliable_kafka.errors import ConfigError, DedupStoreUnavailable, PartitionFenced

StoreFactory = Callable[..., DedupStore]

# Tests never assert that a short lease is still live (a stalled test machine could outlive it); they
# only wait past it, and a late wake-up merely makes it more expired.
LEASE_S = 0.05
PAST_LEASE_S = 0.15


class TransientError(Exception):
    """What a handler raises on its first attempt in these tests."""


def run_redelivered(
    store: DedupStore,
    keys: Sequence[str],
    fail_first_attempt_of: set[str],
    *,
    mark_before_handler: bool = False,
    deliveries: int = 3,
) -> Counter[str]:
    """Deliver the batch `deliveries` times (nothing is committed, so the broker redelivers it all) and
    count each key's effects. `mark_before_handler` is the Watermill-style control: it records a key as
    done before its handler runs."""
    effects: Counter[str] = Counter()
    failures_left = set(fail_first_attempt_of)
    for _ in range(deliveries):
        result = store.claim(keys)
        if mark_before_handler:
            store.confirm(sorted(result.claimed))
        succeeded, failed = [], []
        for key in sorted(result.claimed):
            if key in failures_left:
                failures_left.discard(key)
                failed.append(key)
                continue
            effects[key] += 1
            succeeded.append(key)
        if not mark_before_handler:
            store.confirm(succeeded)
            store.release(failed)
    return effects


class DedupStoreContract:
    """What every DedupStore promises; a subclass provides a `make_store(**kwargs)` fixture whose stores
    share one backend and each have their own owner."""

    def test_new_keys_are_claimed_and_busy_for_another_owner(self, make_store: StoreFactory) -> None:
        a, b = make_store(), make_store()
        assert a.claim(["k1", "k2"]) == ClaimResult(frozenset({"k1", "k2"}), frozenset(), frozenset())
        assert b.claim(["k1", "k2", "k3"]) == ClaimResult(
            frozenset({"k3"}), frozenset(), frozenset({"k1", "k2"})
        )

    def test_confirmed_keys_are_done_for_every_owner(self, make_store: StoreFactory) -> None:
        a, b = make_store(), make_store()
        a.claim(["k1", "k2"])
        a.confirm(["k1"])
        assert a.claim(["k1"]).done == {"k1"}
        result = b.claim(["k1", "k2"])
        assert (result.done, result.busy, result.claimed) == ({"k1"}, {"k2"}, set())

    def test_a_batch_is_partitioned_and_a_repeated_key_counts_once(self, make_store: StoreFactory) -> None:
        a, b = make_store(), make_store()
        a.claim(["old"])
        a.confirm(["old"])
        b.claim(["held"])
        result = a.claim(["new", "old", "held", "new"])
        assert result == ClaimResult(frozenset({"new"}), frozenset({"old"}), frozenset({"held"}))

    def test_an_owner_does_not_claim_its_own_live_claim_twice(self, make_store: StoreFactory) -> None:
        a = make_store()
        a.claim(["k"])
        assert a.claim(["k"]).busy == {"k"}

    def test_release_frees_own_claims_only(self, make_store: StoreFactory) -> None:
        a, b, c = make_store(), make_store(), make_store()
        a.claim(["mine"])
        b.claim(["theirs"])
        a.release(["mine", "theirs", "never-claimed"])
        result = c.claim(["mine", "theirs"])
        assert (result.claimed, result.busy) == ({"mine"}, {"theirs"})

    def test_release_never_frees_a_done_key(self, make_store: StoreFactory) -> None:
        a, b = make_store(), make_store()
        a.claim(["k"])
        a.confirm(["k"])
        a.release(["k"])
        b.release(["k"])
        assert b.claim(["k"]).done == {"k"}

    def test_an_expired_lease_can_be_claimed_by_anyone(self, make_store: StoreFactory) -> None:
        a, b = make_store(), make_store()
        a.claim(["k"], lease_s=LEASE_S)
        time.sleep(PAST_LEASE_S)
        assert b.claim(["k"]).claimed == {"k"}
        assert a.claim(["k"]).busy == {"k"}

    def test_release_after_expiry_leaves_the_new_owner_claim(self, make_store: StoreFactory) -> None:
        a, b, c = make_store(), make_store(), make_store()
        a.claim(["k"], lease_s=LEASE_S)
        time.sleep(PAST_LEASE_S)
        b.claim(["k"])
        a.release(["k"])
        assert c.claim(["k"]).busy == {"k"}

    def test_confirm_after_the_lease_expired_still_records_done(self, make_store: StoreFactory) -> None:
        a, b = make_store(), make_store()
        a.claim(["k"], lease_s=LEASE_S)
        time.sleep(PAST_LEASE_S)
        a.confirm(["k"])
        assert b.claim(["k"]).done == {"k"}

    def test_confirm_over_a_takeover_records_done_and_warns(
        self, make_store: StoreFactory, caplog: pytest.LogCaptureFixture
    ) -> None:
        a, b, c = make_store(), make_store(), make_store()
        a.claim(["k", "calm"], lease_s=LEASE_S)
        time.sleep(PAST_LEASE_S)
        assert b.claim(["k"]).claimed == {"k"}
        with caplog.at_level(logging.WARNING, logger="reliable_kafka.dedup"):
            a.confirm(["k", "calm"])
        assert any("1 key(s)" in record.getMessage() for record in caplog.records)
        b.release(["k"])  # the takeover's handler failed: its release must not undo a's done
        assert c.claim(["k", "calm"]).done == {"k", "calm"}

    def test_a_confirmed_key_is_forgotten_after_retention(self, make_store: StoreFactory) -> None:
        a, b = make_store(retention_s=0.5), make_store()
        a.claim(["k"])
        a.confirm(["k"])
        assert b.claim(["k"]).done == {"k"}
        time.sleep(0.7)
        assert b.claim(["k"]).claimed == {"k"}

    def test_a_failed_handler_is_retried_and_its_effect_happens_once(self, make_store: StoreFactory) -> None:
        keys = [f"m{i}" for i in range(20)]
        effects = run_redelivered(make_store(), keys, fail_first_attempt_of={"m3", "m17"})
        assert effects == Counter(keys)

    def test_control_marking_before_the_handler_loses_the_failed_message(
        self, make_store: StoreFactory
    ) -> None:
        keys = [f"m{i}" for i in range(20)]
        effects = run_redelivered(make_store(), keys, fail_first_attempt_of={"m3"}, mark_before_handler=True)
        assert set(keys) - set(effects) == {"m3"}, "the control must show the loss claim/confirm prevents"

    def test_threads_sharing_one_store_claim_each_key_once(self, make_store: StoreFactory) -> None:
        store = make_store()
        keys = [f"k{i:03d}" for i in range(300)]
        start = threading.Barrier(4)

        def worker() -> list[str]:
            start.wait(timeout=10)
            return [key for i in range(0, len(keys), 15) for key in store.claim(keys[i : i + 15]).claimed]

        with ThreadPoolExecutor(4) as pool:
            claimed = [key for future in [pool.submit(worker) for _ in range(4)] for key in future.result()]
        assert sorted(claimed) == keys

    def test_an_empty_batch_is_answered_empty(self, make_store: StoreFactory) -> None:
        a = make_store()
        assert a.claim([]) == ClaimResult(frozenset(), frozenset(), frozenset())
        a.confirm([])
        a.release([])

    @pytest.mark.parametrize("lease_s", [0, -1.0])
    def test_a_lease_must_be_positive(self, make_store: StoreFactory, lease_s: float) -> None:
        with pytest.raises(ConfigError, match="lease_s"):
            make_store().claim(["k"], lease_s=lease_s)

    def test_the_store_is_a_context_manager_and_a_dedup_store(self, make_store: StoreFactory) -> None:
        with make_store() as store:
            assert isinstance(store, DedupStore)
            assert store.claim(["k"]).claimed == {"k"}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "dedup.db"


@pytest.fixture
def make_store(db_path: Path) -> Iterator[Callable[..., SQLiteDedupStore]]:
    stores: list[SQLiteDedupStore] = []

    def make(**kwargs: Any) -> SQLiteDedupStore:
        store = SQLiteDedupStore(db_path, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


class TestSQLiteDedupStoreContract(DedupStoreContract):
    pass


def _rows(db_path: Path, sql: str) -> list[tuple[Any, ...]]:
    """Read the file through an independent connection, as another process would."""
    with closing(sqlite3.connect(db_path)) as conn:
        return conn.execute(sql).fetchall()


def test_purge_deletes_expired_rows_and_keeps_live_ones(make_store: Callable[..., SQLiteDedupStore]) -> None:
    store = make_store(retention_s=0.1)
    store.claim(["done1", "done2", "stale-claim"], lease_s=LEASE_S)
    store.confirm(["done1", "done2"])
    store.claim(["live-claim"], lease_s=60)
    time.sleep(PAST_LEASE_S)
    assert store.purge_expired() == 3
    assert _rows(Path(store.path), f"SELECT key FROM {TABLE}") == [("live-claim",)]


def test_expired_rows_are_purged_every_n_confirmed_keys(make_store: Callable[..., SQLiteDedupStore]) -> None:
    store = make_store(retention_s=0.3, purge_every=10)
    first = [f"a{i}" for i in range(6)]
    store.claim(first)
    store.confirm(first)
    time.sleep(0.45)
    second = [f"b{i}" for i in range(6)]
    store.claim(second)
    store.confirm(second)  # 12 confirmed keys >= 10: the expired first six go
    assert sorted(key for (key,) in _rows(Path(store.path), f"SELECT key FROM {TABLE}")) == second


def _claim_worker(path: str, keys: list[str], start: Any, results: Any) -> None:
    """One consumer process: claim in small batches, 'apply' each claimed key, confirm; retry busy keys."""
    store = SQLiteDedupStore(path)
    applied: list[str] = []
    start.wait(timeout=30)
    remaining = keys
    deadline = time.monotonic() + 30
    while remaining and time.monotonic() < deadline:
        busy: list[str] = []
        for i in range(0, len(remaining), 10):
            result = store.claim(remaining[i : i + 10])
            time.sleep(0.001)  # the handler: long enough for the other process to contend
            applied.extend(sorted(result.claimed))
            store.confirm(sorted(result.claimed))
            busy.extend(sorted(result.busy))
        remaining = busy
    store.close()
    results.put(applied)


def test_two_processes_on_one_file_apply_each_key_once(db_path: Path) -> None:
    keys = [f"k{i:04d}" for i in range(400)]
    SQLiteDedupStore(db_path).close()  # the schema exists before the race starts
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(2)
    results = ctx.Queue()
    workers = [ctx.Process(target=_claim_worker, args=(str(db_path), keys, start, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        applied = [results.get(timeout=60) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
    counts = Counter(applied[0] + applied[1])
    assert set(counts) == set(keys), f"lost: {sorted(set(keys) - set(counts))[:10]}"
    assert [key for key, n in counts.items() if n > 1] == [], "a key was applied by both processes"


def test_inbox_commits_the_application_row_and_the_confirmation_together(
    make_store: Callable[..., SQLiteDedupStore], db_path: Path
) -> None:
    store, other = make_store(), make_store()
    store.claim(["order-1"])
    with store.inbox() as tx:
        tx.conn.execute("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
        tx.conn.execute("INSERT INTO orders VALUES ('order-1')")
        tx.confirm(["order-1"])
    assert _rows(db_path, "SELECT id FROM orders") == [("order-1",)]
    assert other.claim(["order-1"]).done == {"order-1"}


def test_an_exception_in_the_inbox_rolls_back_both(
    make_store: Callable[..., SQLiteDedupStore], db_path: Path
) -> None:
    store, other = make_store(), make_store()
    with store.inbox() as tx:
        tx.conn.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
    store.claim(["order-1"])
    with pytest.raises(TransientError), store.inbox() as tx:
        tx.conn.execute("INSERT INTO orders VALUES ('order-1')")
        tx.confirm(["order-1"])
        raise TransientError("the handler failed after writing")
    assert _rows(db_path, "SELECT id FROM orders") == []
    assert other.claim(["order-1"]).busy == {"order-1"}, "not done: still only claimed"
    store.release(["order-1"])
    assert other.claim(["order-1"]).claimed == {"order-1"}


def test_an_application_sql_error_in_the_inbox_passes_through_and_rolls_back(
    make_store: Callable[..., SQLiteDedupStore], db_path: Path
) -> None:
    store, other = make_store(), make_store()
    store.claim(["k"])
    with pytest.raises(sqlite3.OperationalError, match="no such table"), store.inbox() as tx:
        tx.confirm(["k"])
        tx.conn.execute("INSERT INTO missing_table VALUES (1)")
    assert other.claim(["k"]).busy == {"k"}
    assert store.claim(["k2"]).claimed == {"k2"}, "the store still works after the rollback"


def test_a_process_killed_inside_the_inbox_leaves_neither_row_nor_confirmation(db_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os
        from reliable_kafka.dedup import SQLiteDedupStore
        store = SQLiteDedupStore({str(db_path)!r})
        store.claim(["order-1"], lease_s={LEASE_S})
        with store.inbox() as tx:
            tx.conn.execute("CREATE TABLE orders (id TEXT PRIMARY KEY)")
            tx.conn.execute("INSERT INTO orders VALUES ('order-1')")
            tx.confirm(["order-1"])
            os._exit(9)  # dies before the commit, as a SIGKILL would
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60, capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    time.sleep(PAST_LEASE_S)
    with SQLiteDedupStore(db_path) as store:
        assert _rows(db_path, "SELECT name FROM sqlite_master WHERE name = 'orders'") == []
        assert store.claim(["order-1"]).claimed == {"order-1"}


def test_a_handler_failing_once_inside_the_inbox_writes_its_row_once(
    make_store: Callable[..., SQLiteDedupStore], db_path: Path
) -> None:
    store = make_store()
    with store.inbox() as tx:
        tx.conn.execute("CREATE TABLE effects (key TEXT)")
    keys = [f"m{i}" for i in range(10)]
    failures_left = {"m4"}
    for _ in range(3):  # every delivery is redelivered: nothing was committed to Kafka
        claimed = sorted(store.claim(keys).claimed)
        failed = []
        for key in claimed:
            try:
                with store.inbox() as tx:
                    tx.conn.execute("INSERT INTO effects VALUES (?)", (key,))
                    if key in failures_left:  # fails AFTER writing: the row must roll back
                        failures_left.discard(key)
                        raise TransientError(key)
                    tx.confirm([key])
            except TransientError:
                failed.append(key)
        store.release(failed)
    assert Counter(key for (key,) in _rows(db_path, "SELECT key FROM effects")) == Counter(keys)


@pytest.mark.parametrize("kind", ["corrupt file", "missing directory", "a directory"])
def test_an_unusable_file_raises_dedup_store_unavailable(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "dedup.db"
    if kind == "corrupt file":
        path.write_bytes(b"this is not a SQLite database" * 200)
    elif kind == "missing directory":
        path = tmp_path / "no-such-dir" / "dedup.db"
    else:
        path.mkdir()
    with pytest.raises(DedupStoreUnavailable, match="dedup.db") as raised:
        SQLiteDedupStore(path)
    assert "fail-closed" in str(raised.value)


def test_a_lock_held_past_the_busy_timeout_fails_fast_then_recovers(
    make_store: Callable[..., SQLiteDedupStore], db_path: Path
) -> None:
    store = make_store(busy_timeout_s=0.2)
    blocker = sqlite3.connect(db_path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        started = time.monotonic()
        with pytest.raises(DedupStoreUnavailable, match="busy_timeout_s=0.2"):
            store.claim(["k"])
        assert time.monotonic() - started < 3
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert store.claim(["k"]).claimed == {"k"}


def test_a_closed_store_is_unavailable(make_store: Callable[..., SQLiteDedupStore]) -> None:
    store = make_store()
    store.close()
    store.close()
    with pytest.raises(DedupStoreUnavailable, match="closed"):
        store.claim(["k"])


# ---- the partition fence -------------------------------------------------------------------


def _lease(epoch: int, partition: int = 0) -> PartitionLease:
    return PartitionLease("g", "t", partition, epoch)


@pytest.mark.parametrize(
    ("holders", "lost"),
    [
        ({("g", "t", 0): ("me", 2)}, False),  # ours, at our epoch
        ({("g", "t", 0): ("me", 3)}, True),  # acquired again since (by this store's owner, elsewhere)
        ({("g", "t", 0): ("other", 2)}, True),  # another owner at the same epoch cannot be ours
        ({("g", "t", 0): ("other", 3)}, True),  # taken over
        ({}, True),  # never taken: nothing to hold
        ({("g", "t", 1): ("me", 2)}, True),  # another partition's row says nothing about this one
    ],
)
def test_a_lease_is_kept_only_while_its_row_names_its_owner_and_epoch(
    holders: dict[tuple[str, str, int], tuple[str, int]], lost: bool
) -> None:
    assert lost_leases([_lease(2)], holders, "me") == ([_lease(2)] if lost else [])


def test_a_later_acquire_fences_the_earlier_holder_out_of_recording(
    make_store: Callable[..., SQLiteDedupStore],
) -> None:
    old, new = make_store(), make_store()
    lease = old.acquire("g", "t", 0)
    assert old.record_done({lease: ["a", "b"]}) == []
    assert old.seen(["a", "b", "c"], [lease]) == (frozenset({"a", "b"}), [])

    taken = new.acquire("g", "t", 0)
    assert taken.epoch == lease.epoch + 1
    assert old.seen(["c"], [lease]) == (frozenset(), [lease])
    assert old.record_done({lease: ["c"]}) == [lease], "the zombie's keys must not be recorded"
    assert new.seen(["c"], [taken]) == (frozenset(), [])
    # Another partition and another group are leased apart.
    other = old.acquire("g", "t", 1)
    assert old.record_done({other: ["d"]}) == []
    assert new.acquire("h", "t", 0).epoch == 1


def test_an_inbox_of_a_fenced_out_store_runs_nothing_and_names_the_partition(
    make_store: Callable[..., SQLiteDedupStore], db_path: Path
) -> None:
    old, new = make_store(), make_store()
    with closing(sqlite3.connect(db_path)) as conn:
        conn.execute("CREATE TABLE fx (payload TEXT)")
        conn.commit()
    old.acquire("g", "orders", 3)
    with old.inbox(["k1"]) as tx:
        tx.conn.execute("INSERT INTO fx VALUES ('k1')")
    new.acquire("g", "orders", 3)
    ran = []
    with pytest.raises(PartitionFenced, match=r"orders\[3\] of group 'g'") as refused, old.inbox(["k2"]) as tx:
        ran.append(True)
        tx.conn.execute("INSERT INTO fx VALUES ('k2')")
    assert refused.value.partitions == [("orders", 3)]
    assert not ran
    assert _rows(db_path, "SELECT payload FROM fx") == [("k1",)]
    assert new.seen(["k1", "k2"], []) == (frozenset({"k1"}), [])


def _record_until_fenced(path: str, started: Any, results: Any) -> None:
    """A consumer process: take partition t[0], then record batches a-0.., a-1.. until the fence refuses one."""
    store = SQLiteDedupStore(path)
    lease = store.acquire("g", "t", 0)
    started.set()
    recorded = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if store.record_done({lease: [f"a-{recorded}-{i}" for i in range(20)]}):
            break
        recorded += 1
        time.sleep(0.002)
    store.close()
    results.put(recorded)


def test_once_another_process_takes_the_lease_the_old_holder_records_nothing(
    make_store: Callable[..., SQLiteDedupStore], db_path: Path
) -> None:
    new = make_store()
    ctx = multiprocessing.get_context("spawn")
    started, results = ctx.Event(), ctx.Queue()
    worker = ctx.Process(target=_record_until_fenced, args=(str(db_path), started, results))
    worker.start()
    try:
        assert started.wait(30)
        count = f"SELECT count(*) FROM {TABLE} WHERE key LIKE 'a-%'"
        deadline = time.monotonic() + 30
        while _rows(db_path, count)[0][0] < 200:  # the old holder is recording: take over mid-stream
            assert time.monotonic() < deadline, "the recording process made no progress"
            time.sleep(0.01)
        new.acquire("g", "t", 0)
        (at_takeover,) = _rows(db_path, count)[0]
        recorded = results.get(timeout=30)
    finally:
        worker.join(timeout=30)
    assert _rows(db_path, count)[0][0] == at_takeover == recorded * 20, "recorded after the takeover"


def test_a_file_of_the_earlier_layout_keeps_its_keys(db_path: Path) -> None:
    with closing(sqlite3.connect(db_path)) as conn:
        conn.execute(f"CREATE TABLE {LEGACY_TABLE} (key TEXT PRIMARY KEY, state TEXT NOT NULL, owner TEXT NOT NULL,"
                     " expires_ms INTEGER NOT NULL)")
        conn.execute(f"INSERT INTO {LEGACY_TABLE} VALUES ('old', 'done', 'x', ?)", (time.time_ns() // 10**6 + 60_000,))
        conn.commit()
    with SQLiteDedupStore(db_path) as store:
        assert store.claim(["old", "new"]).done == {"old"}
    assert _rows(db_path, f"SELECT name FROM sqlite_master WHERE name = '{LEGACY_TABLE}'") == []


def test_purge_walks_every_chunk(make_store: Callable[..., SQLiteDedupStore]) -> None:
    store = make_store(retention_s=0.1, purge_every=3)  # chunks of 3 rows: ten keys take four
    lease = store.acquire("g", "t", 0)
    store.record_done({lease: [f"k{i}" for i in range(2)]})
    store.record_done({lease: [f"k{i}" for i in range(2, 10)]})  # 10 recorded: a chunk of 6 went by now
    time.sleep(PAST_LEASE_S)
    store.claim(["live"], lease_s=60)
    assert store.purge_expired() == 10
    assert _rows(Path(store.path), f"SELECT key FROM {TABLE}") == [("live",)]
