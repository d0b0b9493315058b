"""One stats type: Counters never lose an increment across threads, and the Stats snapshot every client's
stats() returns reads as attributes and as a mapping, never changes, and has the client's names from the start.
"""

from __future__ import annotations

import pickle
import threading
import warnings

import pytest

from reliable_kafka import ReliableConsumer, Stats
from reliable_kafka.consumer.front import STATS as CONSUMER_STATS
from reliable_kafka.stats import Counters

NOWHERE = {"bootstrap.servers": "127.0.0.1:9", "group.id": "stats"}  # never contacted


def test_a_snapshot_reads_as_attributes_and_as_a_mapping() -> None:
    counters = Counters(("handled", "dead_lettered"))
    counters.add("handled", 3)
    s = counters.stats()
    assert s.handled == s["handled"] == 3
    assert s.dead_lettered == 0, "a named counter is there before anything happened"
    assert dict(s) == {"handled": 3, "dead_lettered": 0}
    assert list(s) == ["handled", "dead_lettered"] and len(s) == 2 and "handled" in s
    assert s == {"handled": 3, "dead_lettered": 0} and s == Stats(handled=3, dead_lettered=0)
    assert repr(s) == "Stats(handled=3, dead_lettered=0)"
    assert pickle.loads(pickle.dumps(s)) == s


def test_a_snapshot_never_changes() -> None:
    counters = Counters(("handled",))
    s = counters.stats()
    counters.add("handled")
    assert s.handled == 0 and counters.stats().handled == 1
    with pytest.raises(AttributeError, match="snapshot"):
        s.handled = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        s["handled"] = 5  # type: ignore[index]


def test_an_unknown_name_says_which_names_there_are() -> None:
    s = Stats(handled=1)
    with pytest.raises(AttributeError, match=r"no counter 'handeld'; it has \['handled'\]"):
        _ = s.handeld
    with pytest.raises(KeyError):
        _ = s["handeld"]


def test_increments_from_many_threads_are_never_lost() -> None:
    counters = Counters(("n",))
    threads = [threading.Thread(target=lambda: [counters.add("n") for _ in range(10_000)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counters.get("n") == 80_000


def test_the_consumer_reports_every_name_from_the_start() -> None:
    c = ReliableConsumer(NOWHERE, ["orders"])
    c.close(0.1)
    s = c.stats()
    assert isinstance(s, Stats)
    assert dict(s) == dict.fromkeys(CONSUMER_STATS, 0)
    assert s.handled == 0 and s.commit_failures == 0


def test_the_consumers_counts_still_work_and_name_stats() -> None:
    c = ReliableConsumer(NOWHERE, ["orders"])
    c.close(0.1)
    expected = r"ReliableConsumer\.counts is deprecated .*: use ReliableConsumer\.stats\(\) instead"
    with pytest.warns(DeprecationWarning, match=expected) as caught:
        counts = c.counts
    assert caught[0].filename == __file__  # pointing at the caller, not at the library
    assert type(counts) is dict and counts == dict(c.stats())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c.stats()


def test_a_single_writer_name_added_unlocked_is_counted_and_read_consistently() -> None:
    counters = Counters(("sent", "delivered"))
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            seen.append(counters.stats().sent)

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(50_000):
        counters.add_unlocked("sent", 2)  # the one writer of "sent"
        counters.add("delivered")
    stop.set()
    t.join()
    assert counters.stats() == {"sent": 100_000, "delivered": 50_000}
    assert seen == sorted(seen) and all(n % 2 == 0 for n in seen), "snapshots only ever see whole adds, in order"
