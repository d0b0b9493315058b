"""The consumer's hot path (FastStrategy): which offsets a handled batch makes committable, and when the
commit coordinator commits. No broker: the records are built in memory and handed to the strategy as a
fetch would hand them over; a stand-in client records commits and is never polled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import Message

from reliable_kafka import CommitPolicy, ConfigError, ReliableConsumer
from reliable_kafka.consumer.commits import CommitCoordinator
from reliable_kafka.consumer.strategies import FastStrategy
from reliable_kafka.stats import Counters
from tests.fixtures.consumer_parts import Clock, NoBroker, T, batch, parts

NOWHERE = {"bootstrap.servers": "127.0.0.1:9", "group.id": "hot-path"}  # never contacted


@dataclass
class HotPath:
    fast: FastStrategy
    commits: CommitCoordinator
    counters: Counters
    clock: Clock
    client: NoBroker
    handled: list[tuple[int, int]]


def hot_path(topics: tuple[str, ...] = (T,), commit: CommitPolicy | None = None,
             handler: Callable[[Message], Any] | None = None) -> HotPath:
    """The strategy a single-thread run() without dedup or tracing uses, on parts wired as ReliableConsumer
    wires them."""
    p = parts(commit)
    handled: list[tuple[int, int]] = []
    record = handler or (lambda m: handled.append((m.partition(), m.offset())))
    single_topic = topics[0] if len(topics) == 1 else None
    fast = FastStrategy(record, p.fetcher, p.failures, p.commits, p.counters, single_topic)
    return HotPath(fast, p.commits, p.counters, p.clock, p.client, handled)


@pytest.fixture
def hp() -> Iterator[HotPath]:
    yield hot_path()


def test_a_batch_of_one_partition_is_committable_through_its_last_record(hp: HotPath) -> None:
    hp.fast.handle_fetched(batch(*((0, o) for o in range(10, 20))))
    assert hp.commits.committable() == {(T, 0): 20}
    assert hp.counters.get("handled") == 10


def test_a_mixed_batch_advances_every_partition_in_it(hp: HotPath) -> None:
    hp.fast.handle_fetched(batch((0, 10), (1, 5), (1, 6), (0, 11), (2, 0), (0, 12)))
    assert hp.commits.committable() == {(T, 0): 13, (T, 1): 7, (T, 2): 1}
    assert len(hp.handled) == 6


def test_records_inside_a_gap_of_another_partition_are_never_passed_only_delayed(hp: HotPath) -> None:
    # Partition 0 jumps 10 -> 12 (a transaction marker at 11) around one record of partition 1:
    # first and last are partition 0 and the span equals the batch, so the O(1) check takes the
    # batch for partition 0's alone. Partition 1's record was handled but is not advanced now...
    hp.fast.handle_fetched(batch((0, 10), (1, 5), (0, 12)))
    assert hp.handled == [(0, 10), (1, 5), (0, 12)]
    assert hp.commits.committable() == {(T, 0): 13}
    # ...and the next batch that ends in partition 1 advances it past that record.
    hp.fast.handle_fetched(batch((1, 6), (1, 7)))
    assert hp.commits.committable() == {(T, 0): 13, (T, 1): 8}


def test_first_and_last_of_one_partition_with_another_between_is_not_taken_for_one(hp: HotPath) -> None:
    hp.fast.handle_fetched(batch((0, 10), (1, 5), (0, 11)))
    assert hp.commits.committable() == {(T, 0): 12, (T, 1): 6}


def test_several_topics_take_the_exact_path() -> None:
    hp = hot_path((T, "payments"))
    hp.fast.handle_fetched(batch((0, 1), (0, 2)) + batch((0, 7), (0, 8), topic="payments"))
    assert hp.commits.committable() == {(T, 0): 3, ("payments", 0): 9}


def test_a_record_that_fails_for_good_without_a_dlq_stops_its_partition_there() -> None:
    def handler(m: Message) -> None:
        if m.offset() == 13:
            raise ValueError("poison")

    hp = hot_path(handler=handler)
    hp.fast.handle_fetched(batch(*((0, o) for o in range(10, 20))))
    assert hp.commits.committable() == {(T, 0): 13}  # 13 is held (no DLQ); 14..19 wait behind it
    assert hp.counters.get("handled") == 9
    assert hp.commits.tracker.in_flight() == 1


def test_by_default_commits_follow_the_interval_not_a_count(hp: HotPath, monkeypatch: pytest.MonkeyPatch) -> None:
    commits: list[int] = []
    monkeypatch.setattr(hp.commits, "commit_async", lambda: commits.append(hp.commits.pending))
    hp.fast.handle_fetched(batch(*((0, o) for o in range(100_000))))
    hp.commits.maybe_commit()
    assert commits == []  # 100,000 records within the interval: no commit yet
    hp.clock.now += CommitPolicy().interval_s
    hp.commits.maybe_commit()
    assert commits == [100_000]


def test_an_interval_commit_sends_what_is_committable_asynchronously(hp: HotPath) -> None:
    hp.fast.handle_fetched(batch(*((0, o) for o in range(10))))
    hp.clock.now += CommitPolicy().interval_s
    hp.commits.maybe_commit()
    assert hp.client.commits == [{(T, 0): 10}]
    assert hp.commits.pending == 0 and hp.counters.get("commits") == 1


def test_commit_every_adds_a_count_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    hp = hot_path(commit=CommitPolicy(every=1_000))
    commits: list[int] = []
    monkeypatch.setattr(hp.commits, "commit_async", lambda: commits.append(hp.commits.pending))
    hp.fast.handle_fetched(batch(*((0, o) for o in range(999))))
    hp.commits.maybe_commit()
    hp.fast.handle_fetched(batch((0, 999)))
    hp.commits.maybe_commit()
    assert commits == [1_000]


def test_commit_every_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="every"):
        CommitPolicy(every=0)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="every"):
        ReliableConsumer(NOWHERE, [T], commit_every=0)
