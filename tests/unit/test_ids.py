"""rk-ids: unique, increasing within a process, valid UUIDv7, distinct across forked processes."""

from __future__ import annotations

import os
import time
import uuid
import warnings
from collections.abc import Callable

import pytest

from reliable_kafka.ids import id_timestamp_ms, new_id, new_ids


def test_ids_are_unique_and_increasing_across_calls_and_counter_overflow() -> None:
    # 10,000 in one call cannot fit one millisecond's 4,096 counter values: it borrows the next ones.
    ids = new_ids(10_000) + new_ids(1) + [new_id() for _ in range(3_000)] + new_ids(5_000)
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)


def test_ids_are_uuid_version_7_with_the_time_they_were_made() -> None:
    before = time.time_ns() // 1_000_000
    ids = new_ids(50)
    after = time.time_ns() // 1_000_000
    for i in ids:
        u = uuid.UUID(i)
        assert (u.version, u.variant) == (7, uuid.RFC_4122)
        assert str(u) == i
    # Borrowed milliseconds can run a little ahead of the clock, never behind it.
    assert before <= id_timestamp_ms(ids[0]) <= id_timestamp_ms(ids[-1]) <= after + 3


def _parent_and_forked_child_ids(mint: Callable[[], list[str]]) -> tuple[set[str], set[str]]:
    """What `mint()` returns in a forked child (at once, as a Spark worker would after a fork) and in the
    parent meanwhile."""
    read, write = os.pipe()
    # Python 3.12+ warns that a fork of a process with threads (pytest's, xdist's) may deadlock the child;
    # the child here only mints ids and writes them, as a Spark worker forked from its daemon would.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, "\n".join(mint()).encode())
        os._exit(0)
    os.close(write)
    parent = set(mint())
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    return parent, set(b"".join(chunks).decode().split("\n"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    parent, child = _parent_and_forked_child_ids(lambda: new_ids(2_000))
    assert len(child) == 2_000
    assert not parent & child


def test_ids_minted_by_many_threads_at_once_are_unique_and_increasing_within_each_thread() -> None:
    import threading

    per_thread: list[list[str]] = []
    go = threading.Barrier(16)

    def mint() -> None:
        go.wait()
        mine = [new_id() for _ in range(5_000)] + new_ids(100) + [new_id() for _ in range(100)]
        per_thread.append(mine)

    threads = [threading.Thread(target=mint) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for mine in per_thread for i in mine]
    assert len(every) == 16 * 5_200 and len(set(every)) == len(every)
    for mine in per_thread:
        assert mine == sorted(mine)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_its_parents_single_ids() -> None:
    new_id()  # this thread's new_id() state exists before the fork, and the child inherits it
    parent, child = _parent_and_forked_child_ids(lambda: [new_id() for _ in range(2_000)])
    assert len(child) == 2_000
    assert not parent & child
