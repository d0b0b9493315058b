"""The consumer's hot path (`_run_fast`): which offsets a handled batch makes committable, and when
periodic commits happen. No broker: the records are built in memory and handed to the hot path as a
fetch would hand them over; the client is never polled.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from confluent_kafka import Message

from reliable_kafka import ConfigError, ReliableConsumer

T = "orders"
NOWHERE = {"bootstrap.servers": "127.0.0.1:9", "group.id": "hot-path"}  # never contacted


@pytest.fixture
def consumer() -> Iterator[ReliableConsumer]:
    c = ReliableConsumer(NOWHERE, [T], dead_letter=None)
    handled: list[tuple[int, int]] = []
    c._handler = lambda m: handled.append((m.partition(), m.offset()))
    c.handled = handled  # type: ignore[attr-defined]
    yield c
    c._consumer.close()


def batch(*records: tuple[int, int], topic: str = T) -> list[Message]:
    return [Message(topic=topic, partition=p, offset=o, value=f"{p}:{o}".encode()) for p, o in records]


def test_a_batch_of_one_partition_is_committable_through_its_last_record(consumer: ReliableConsumer) -> None:
    consumer._run_fast(batch(*((0, o) for o in range(10, 20))))
    assert consumer._tracker.committable() == {(T, 0): 20}
    assert consumer.counts["handled"] == 10


def test_a_mixed_batch_advances_every_partition_in_it(consumer: ReliableConsumer) -> None:
    consumer._run_fast(batch((0, 10), (1, 5), (1, 6), (0, 11), (2, 0), (0, 12)))
    assert consumer._tracker.committable() == {(T, 0): 13, (T, 1): 7, (T, 2): 1}
    assert len(consumer.handled) == 6  # type: ignore[attr-defined]


def test_records_inside_a_gap_of_another_partition_are_never_passed_only_delayed(
        consumer: ReliableConsumer) -> None:
    # Partition 0 jumps 10 -> 12 (a transaction marker at 11) around one record of partition 1:
    # first and last are partition 0 and the span equals the batch, so the O(1) check takes the
    # batch for partition 0's alone. Partition 1's record was handled but is not advanced now...
    consumer._run_fast(batch((0, 10), (1, 5), (0, 12)))
    assert consumer.handled == [(0, 10), (1, 5), (0, 12)]  # type: ignore[attr-defined]
    assert consumer._tracker.committable() == {(T, 0): 13}
    # ...and the next batch that ends in partition 1 advances it past that record.
    consumer._run_fast(batch((1, 6), (1, 7)))
    assert consumer._tracker.committable() == {(T, 0): 13, (T, 1): 8}


def test_first_and_last_of_one_partition_with_another_between_is_not_taken_for_one(
        consumer: ReliableConsumer) -> None:
    consumer._run_fast(batch((0, 10), (1, 5), (0, 11)))
    assert consumer._tracker.committable() == {(T, 0): 12, (T, 1): 6}


def test_several_topics_take_the_exact_path() -> None:
    c = ReliableConsumer(NOWHERE, [T, "payments"], dead_letter=None)
    try:
        c._handler = lambda m: None
        c._run_fast(batch((0, 1), (0, 2)) + batch((0, 7), (0, 8), topic="payments"))
        assert c._tracker.committable() == {(T, 0): 3, ("payments", 0): 9}
    finally:
        c._consumer.close()


def test_by_default_commits_follow_the_interval_not_a_count(consumer: ReliableConsumer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    commits: list[int] = []
    monkeypatch.setattr(consumer, "_commit_async", lambda: commits.append(consumer._since_commit))
    consumer._run_fast(batch(*((0, o) for o in range(100_000))))
    consumer.maybe_commit()
    assert commits == []  # 100,000 records within the interval: no commit yet
    consumer._last_commit -= consumer._commit_interval_s
    consumer.maybe_commit()
    assert commits == [100_000]


def test_commit_every_adds_a_count_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    c = ReliableConsumer(NOWHERE, [T], dead_letter=None, commit_every=1_000)
    try:
        c._handler = lambda m: None
        commits: list[int] = []
        monkeypatch.setattr(c, "_commit_async", lambda: commits.append(c._since_commit))
        c._run_fast(batch(*((0, o) for o in range(999))))
        c.maybe_commit()
        c._run_fast(batch((0, 999)))
        c.maybe_commit()
        assert commits == [1_000]
    finally:
        c._consumer.close()


def test_commit_every_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="commit_every"):
        ReliableConsumer(NOWHERE, [T], commit_every=0)
