"""The consumer's parts through their own seams: the dedup-claimed strategy and its partition fence, the worker
strategy's counts, and the rebalance handler forgetting what each part keeps for a released partition. No broker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Message, TopicPartition

from reliable_kafka import DedupPolicy, RetryPolicy, SQLiteDedupStore
from reliable_kafka.consumer.strategies import choose
from tests.fixtures.consumer_parts import Parts, T, batch, parts


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteDedupStore]:
    s = SQLiteDedupStore(tmp_path / "dedup.db")
    yield s
    s.close()


def strategy(p: Parts, handler, *, concurrency: int = 1):  # type: ignore[no-untyped-def]
    return choose(handler, batch=False, concurrency=concurrency, tracing=False, dedup=p.dedup, single_topic=T,
                  fetcher=p.fetcher, failures=p.failures, commits=p.commits, counters=p.counters)


def test_the_claimed_path_skips_confirmed_keys_and_commits_only_after_confirming(store: SQLiteDedupStore) -> None:
    store.claim(["id-0-11"], 60)
    store.confirm(["id-0-11"])  # handled by an earlier run
    p = parts(dedup=DedupPolicy(store))
    handled: list[int] = []
    s = strategy(p, lambda m: handled.append(m.offset()))
    s.handle_fetched(batch((0, 10), (0, 11), (0, 12), ids=True))
    assert handled == [10, 12]
    assert p.counters.get("duplicates_skipped") == 1
    assert p.commits.committable() == {}  # 10 and 12 ran, but their keys are not confirmed yet
    assert p.commits.commit() == {(T, 0): 13}  # the commit confirms them first
    assert store.claim(["id-0-10", "id-0-12"], 60).done == {"id-0-10", "id-0-12"}


def test_workers_lose_no_count_and_commit_every_partition_through_its_end() -> None:
    p = parts()
    s = strategy(p, lambda m: None, concurrency=4)
    try:
        for start in range(0, 4_000, 500):
            s.handle_fetched(batch(*((part, o) for o in range(start, start + 500) for part in range(8))))
        assert s.wait_idle(10)
    finally:
        s.close(10)
    assert p.counters.get("handled") == 32_000
    assert p.commits.committable() == {(T, part): 4_000 for part in range(8)}


def test_a_revoke_commits_the_revoked_partitions_processed_offsets_before_releasing_them() -> None:
    p = parts()
    strategy(p, lambda m: None).handle_fetched(batch((0, 5), (0, 6), (1, 9)))
    p.rebalance.on_revoke(None, [TopicPartition(T, 0)])  # type: ignore[arg-type]
    assert p.client.commits == [{(T, 0): 7}]
    assert p.commits.committable() == {(T, 1): 10}  # partition 1 stays ours, uncommitted


def test_records_waiting_for_a_worker_when_their_partition_is_released_are_left_for_the_new_owner() -> None:
    p = parts()  # revoke_timeout_s=1
    gate = threading.Event()
    ran: list[tuple[int, int]] = []

    def handler(m: Message) -> None:
        if (m.partition(), m.offset()) == (0, 0):
            gate.wait(10)  # still running when the revoke gives up waiting
        ran.append((m.partition(), m.offset()))

    s = strategy(p, handler, concurrency=2)
    p.rebalance.wait_idle = s.wait_idle  # as run() sets it
    try:
        # One key per partition: partition 0's records queue behind offset 0 on one worker.
        s.handle_fetched([Message(topic=T, partition=part, offset=o, key=f"k{part}".encode())
                          for part in (0, 1) for o in range(6)])
        p.rebalance.on_revoke(None, [TopicPartition(T, 0)])  # type: ignore[arg-type]  # times out after 1 s
        gate.set()
        assert s.wait_idle(10)  # partition 1's records all finish
        deadline = time.monotonic() + 10
        while p.counters.get("left_for_new_owner") < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        s.close(10)
    assert [r for r in ran if r[0] == 0] == [(0, 0)], "records queued behind the revoke ran after it"
    assert sorted(r for r in ran if r[0] == 1) == [(1, o) for o in range(6)]
    assert p.counters.get("left_for_new_owner") == 5
    assert p.client.commits == []  # offset 0 still ran at the revoke: nothing of partition 0 was committable
    assert p.commits.committable() == {(T, 1): 6}


def test_records_held_back_by_the_fetcher_are_not_waited_for_by_a_revoke_or_a_stop() -> None:
    """Records the fetcher holds back (fetched while paused, a busy dedup key) run only once the fetch loop
    hands them over, which it cannot do while a revoke on its thread, or the graceful stop after its last
    pass, waits for what is in flight: a wait that counted them lasted its whole timeout for nothing."""
    p = parts()
    s = strategy(p, lambda m: None, concurrency=2)
    p.rebalance.wait_idle = s.wait_idle  # as run() sets it
    try:
        s.handle_fetched(batch((0, 0), (1, 0)))  # run by the workers
        held = p.fetcher.track(batch((0, 1), (0, 2), (1, 1)))
        p.fetcher.hold([p.fetcher.work(m) for m in held], 0)  # as a paused pass or a busy key leaves them
        started = time.monotonic()
        assert s.wait_idle(5, {(T, 0)}) and s.wait_idle(5)
        p.rebalance.on_revoke(None, [TopicPartition(T, 0)])  # type: ignore[arg-type]
    finally:
        s.close(5)
    assert time.monotonic() - started < 2, "a wait counted the held records"
    assert p.client.commits == [{(T, 0): 1}]  # up to the held record: it is redelivered, never skipped
    assert p.commits.committable() == {(T, 1): 1}


def test_a_lost_partition_is_forgotten_by_every_part_that_kept_something_of_it() -> None:
    def handler(m: Message) -> None:
        if m.offset() == 1:
            raise ValueError("poison")  # no DLQ: the record is held as stuck

    p = parts()
    strategy(p, handler).handle_fetched(batch((0, 0), (0, 1), (0, 2), (1, 0)))
    assert p.dead_letters.stuck_count() == 1 and p.commits.committable() == {(T, 0): 1, (T, 1): 1}
    p.fetcher.hold([p.fetcher.work(m) for m in p.fetcher.track(batch((0, 3), (1, 1)))], 0)
    p.rebalance.on_lost(None, [TopicPartition(T, 0)])  # type: ignore[arg-type]
    assert p.dead_letters.stuck_count() == 0
    assert p.commits.committable() == {(T, 1): 1}  # partition 0's staged offset is dropped, not committed
    assert p.client.commits == []
    handled: list[tuple[int, int]] = []
    p.fetcher.step(strategy(p, lambda m: handled.append((m.partition(), m.offset()))))
    assert handled == [(1, 1)]  # of the held records, only partition 1's are left


def test_counters_take_increments_from_many_threads() -> None:
    p = parts()
    threads = [threading.Thread(target=lambda: [p.counters.add("handled") for _ in range(10_000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.counters.snapshot() == {"handled": 80_000}


def test_a_missing_subscribed_topic_is_said_once_with_the_fix_however_often_librdkafka_repeats_it(
        caplog: pytest.LogCaptureFixture) -> None:
    from confluent_kafka import KafkaError

    p = parts()
    missing = [Message(topic="nope", error=KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))]
    with caplog.at_level(logging.DEBUG, logger="reliable_kafka.consumer.fetcher"):
        for offset in range(5):  # e.g. after each rebalance or metadata refresh, beside real records
            kept = p.fetcher.track(missing + batch((0, offset)))
            assert [m.offset() for m in kept] == [offset]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'nope' does not exist" in warnings[0] and "ensure_topic" in warnings[0]
    assert sum("still does not exist" in r.getMessage() for r in caplog.records) == 4


def test_a_partition_taken_over_records_nothing_commits_nothing_and_waits_for_its_next_assignment(
    store: SQLiteDedupStore, tmp_path: Path,
) -> None:
    p = parts(dedup=DedupPolicy(store))
    handled: list[int] = []
    s = strategy(p, lambda m: handled.append(m.offset()))
    assert p.dedup is not None and p.dedup.fenced, "one thread and a SQLite store: the fence"
    s.handle_fetched(batch((0, 10), (0, 11), ids=True))
    assert p.commits.commit() == {(T, 0): 12}
    s.handle_fetched(batch((0, 12), (1, 5), ids=True))
    with SQLiteDedupStore(tmp_path / "dedup.db") as new:
        new.acquire("unit", T, 0)  # this consumer was paused past its session: a new owner took partition 0
        assert p.commits.commit() == {(T, 1): 6}, "partition 0's batch must be neither recorded nor committed"
        assert new.seen(["id-0-12", "id-1-5"], []) == (frozenset({"id-1-5"}), [])
    assert (T, 0) in p.client.paused
    s.handle_fetched(batch((0, 13), ids=True))  # prefetched before the pause: dropped with its partition
    assert handled == [10, 11, 12, 5]
    p.rebalance.on_assign(None, [TopicPartition(T, 0)])  # type: ignore[arg-type]  # the group gives it back
    s.handle_fetched(batch((0, 13), ids=True))
    assert handled[-1] == 13 and p.commits.commit() == {(T, 0): 14}


def test_a_handler_whose_inbox_is_fenced_is_neither_retried_nor_dead_lettered(
    store: SQLiteDedupStore, tmp_path: Path,
) -> None:
    retry = RetryPolicy(attempts=5, initial_backoff_s=30, max_backoff_s=30, jitter=False)
    p = parts(dedup=DedupPolicy(store), retry=retry)
    with store.inbox() as tx:
        tx.conn.execute("CREATE TABLE fx (offset INTEGER)")
    new = SQLiteDedupStore(tmp_path / "dedup.db")

    def handler(m: Message) -> None:
        if m.offset() == 3:
            new.acquire("unit", T, 0)  # the owner stalls here; meanwhile a new one takes partition 0 over
        with store.inbox([f"id-0-{m.offset()}"]) as tx:
            tx.conn.execute("INSERT INTO fx VALUES (?)", (m.offset(),))

    s = strategy(p, handler)
    s.handle_fetched(batch((0, 1), ids=True))
    assert p.commits.commit() == {(T, 0): 2}
    started = time.monotonic()
    s.handle_fetched(batch((0, 2), (0, 3), (0, 4), ids=True))  # 2 is applied before the takeover
    assert time.monotonic() - started < 5, "a fenced record must not wait for retries"
    new.close()
    with store.inbox() as tx:
        assert tx.conn.execute("SELECT offset FROM fx").fetchall() == [(1,), (2,)]
    assert p.dead_letters.stuck_count() == 0 and p.counters.get("dead_lettered") == 0
    assert p.commits.commit() == {}, "2 is the new owner's to skip (done), 3 and 4 its to run"
    assert (T, 0) in p.client.paused
