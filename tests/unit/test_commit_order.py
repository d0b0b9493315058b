"""The order in which commits land. The group keeps the last offset written, not the highest, and
librdkafka retries a commit that timed out or lost its coordinator by itself: an older commit can land
after a newer one. The commit coordinator keeps one asynchronous commit in flight, commits again when an
older one landed last, and retries a failed one even when nothing new was processed. No broker: the
client's reports are handed to on_commit() as consume() would serve them."""

from __future__ import annotations

from confluent_kafka import KafkaError, TopicPartition

from reliable_kafka import CommitPolicy
from reliable_kafka.consumer.strategies import FastStrategy
from tests.fixtures.consumer_parts import Parts, T, batch, parts

INTERVAL = CommitPolicy().interval_s


def handled(p: Parts, *records: tuple[int, int]) -> None:
    FastStrategy(lambda m: None, p.fetcher, p.failures, p.commits, p.counters, T).handle_fetched(batch(*records))


def tick(p: Parts) -> None:
    p.clock.now += INTERVAL
    p.commits.maybe_commit()


def report(p: Parts, offsets: dict[int, int], err: KafkaError | None = None) -> None:
    p.commits.on_commit(err, [TopicPartition(T, part, o) for part, o in offsets.items()])


def test_a_second_asynchronous_commit_waits_for_the_first_to_report() -> None:
    p = parts()
    handled(p, (0, 0), (0, 1))
    tick(p)
    handled(p, (0, 2), (0, 3))
    tick(p)
    assert p.client.commits == [{(T, 0): 2}]  # the first has not reported: nothing else is sent
    report(p, {0: 2})
    tick(p)
    assert p.client.commits == [{(T, 0): 2}, {(T, 0): 4}] and p.client.asynchronous == [True, True]


def test_an_older_commit_that_lands_after_a_newer_one_is_committed_again() -> None:
    p = parts()
    handled(p, (0, 0), (0, 1))
    tick(p)  # async: offset 2, in flight
    handled(p, (0, 2), (0, 3))
    p.commits.commit()  # a synchronous one (a revoke's, say) confirms 4 meanwhile
    report(p, {0: 2})  # then the older one lands: the group now holds 2
    assert p.commits.committable() == {(T, 0): 4}
    tick(p)  # nothing new was processed, yet 4 is sent again
    assert p.client.commits[-1] == {(T, 0): 4}


def test_a_failed_commit_at_the_end_of_a_stream_is_retried_synchronously() -> None:
    p = parts()
    handled(p, (0, 0), (0, 1), (0, 2))
    tick(p)
    report(p, {0: 3}, KafkaError(KafkaError.REQUEST_TIMED_OUT))
    tick(p)  # no new record since: still committed, synchronously
    assert p.client.commits == [{(T, 0): 3}, {(T, 0): 3}] and p.client.asynchronous == [True, False]
    assert p.commits.committable() == {}


def test_an_unanswered_asynchronous_commit_gives_way_to_a_synchronous_one() -> None:
    p = parts()
    handled(p, (0, 0))
    tick(p)
    handled(p, (0, 1))
    p.clock.now += CommitPolicy().timeout_s
    p.commits.maybe_commit()
    assert p.client.commits == [{(T, 0): 1}, {(T, 0): 2}] and p.client.asynchronous == [True, False]
