"""OffsetTracker: a commit never passes unfinished work, whatever the order of completions."""

from __future__ import annotations

import queue
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from reliable_kafka.offsets import OffsetTracker, TopicPartition

T = "orders"
TP: TopicPartition = (T, 0)


def test_in_order_completion_commits_last_plus_one() -> None:
    tracker = OffsetTracker()
    for offset in range(5):
        tracker.track(T, 0, offset)
    for offset in range(5):
        tracker.done(T, 0, offset)
    assert tracker.committable() == {TP: 5}


def test_nothing_is_committable_before_the_first_offset_is_done() -> None:
    tracker = OffsetTracker()
    tracker.track(T, 0, 100)
    tracker.track(T, 0, 101)
    tracker.done(T, 0, 101)
    assert tracker.committable() == {}


def test_a_gap_holds_the_commit_back_until_it_is_filled() -> None:
    tracker = OffsetTracker()
    for offset in (10, 11, 12, 13):
        tracker.track(T, 0, offset)
    tracker.done(T, 0, 10)
    tracker.done(T, 0, 12)
    tracker.done(T, 0, 13)
    assert tracker.committable() == {TP: 11}  # 11 is still running
    tracker.done(T, 0, 11)
    assert tracker.committable() == {TP: 14}


def test_holes_in_the_offsets_do_not_block_progress() -> None:
    # 6, 7 were compacted away and 10 is a transaction marker: they are never handed out.
    tracker = OffsetTracker()
    for offset in (5, 8, 9, 11):
        tracker.track(T, 0, offset)
    tracker.done(T, 0, 5)
    assert tracker.committable() == {TP: 6}
    tracker.done(T, 0, 9)
    tracker.done(T, 0, 11)
    assert tracker.committable() == {TP: 6}
    tracker.done(T, 0, 8)
    assert tracker.committable() == {TP: 12}


def test_partitions_are_independent() -> None:
    tracker = OffsetTracker()
    tracker.track(T, 0, 0)
    tracker.track(T, 1, 0)
    tracker.track("other", 0, 7)
    tracker.done(T, 1, 0)
    tracker.done("other", 0, 7)
    assert tracker.committable() == {(T, 1): 1, ("other", 0): 8}


def test_committable_only_reports_partitions_that_moved_since_the_last_commit() -> None:
    tracker = OffsetTracker()
    for offset in range(4):
        tracker.track(T, 0, offset)
        tracker.track(T, 1, offset)
    tracker.done(T, 0, 0)
    tracker.done(T, 1, 0)
    tracker.mark_committed(tracker.committable())
    assert tracker.committable() == {}
    tracker.done(T, 0, 1)
    assert tracker.committable() == {TP: 2}
    # A commit that failed is simply not marked: the same offsets are offered again.
    assert tracker.committable() == {TP: 2}


def test_a_late_acknowledgement_of_an_older_commit_does_not_move_back() -> None:
    tracker = OffsetTracker()
    for offset in range(3):
        tracker.track(T, 0, offset)
        tracker.done(T, 0, offset)
    tracker.mark_committed({TP: 3})
    tracker.mark_committed({TP: 1})
    assert tracker.committable() == {}


def test_mark_committed_ignores_partitions_no_longer_held() -> None:
    tracker = OffsetTracker()
    tracker.mark_committed({("gone", 3): 42})
    tracker.track("gone", 3, 0)
    tracker.done("gone", 3, 0)
    assert tracker.committable() == {("gone", 3): 1}


@pytest.mark.parametrize("offset", [3, 99])
def test_done_for_an_offset_never_tracked_is_refused(offset: int) -> None:
    tracker = OffsetTracker()
    tracker.track(T, 0, 1)
    tracker.track(T, 0, 5)
    with pytest.raises(ValueError, match="not in flight"):
        tracker.done(T, 0, offset)
    with pytest.raises(ValueError, match="not in flight"):
        tracker.done(T, 9, 1)  # partition never tracked


def test_done_twice_is_refused_and_changes_nothing() -> None:
    tracker = OffsetTracker()
    tracker.track(T, 0, 1)
    tracker.track(T, 0, 2)
    tracker.done(T, 0, 2)
    with pytest.raises(ValueError):
        tracker.done(T, 0, 2)
    assert tracker.in_flight() == 1
    assert tracker.committable() == {}


@pytest.mark.parametrize("offset", [4, 3, -1])
def test_offsets_must_increase_per_partition(offset: int) -> None:
    tracker = OffsetTracker()
    tracker.track(T, 0, 4)
    with pytest.raises(ValueError, match="reset"):
        tracker.track(T, 0, offset)
    assert tracker.in_flight() == 1


def test_drop_forgets_staged_offsets_and_makes_old_completions_stale() -> None:
    tracker = OffsetTracker()
    epoch = tracker.track(T, 0, 0)
    tracker.track(T, 0, 1)
    tracker.track(T, 1, 0)
    tracker.done(T, 0, 1)
    tracker.drop([TP])
    assert tracker.in_flight(T, 0) == 0
    assert tracker.in_flight() == 1
    assert tracker.done(T, 0, 0, epoch) is False
    with pytest.raises(ValueError):
        tracker.done(T, 0, 0)  # without an epoch the caller gets told
    assert tracker.committable() == {}


def test_a_stale_completion_does_not_mark_a_redelivered_record_done() -> None:
    # Partition lost while offset 7 was being handled; it comes back and 7 is delivered again.
    tracker = OffsetTracker()
    old_epoch = tracker.track(T, 0, 7)
    tracker.drop([TP])
    new_epoch = tracker.track(T, 0, 7)
    assert new_epoch != old_epoch
    assert tracker.done(T, 0, 7, old_epoch) is False  # the old worker finishes late
    assert tracker.committable() == {}
    assert tracker.in_flight() == 1
    assert tracker.done(T, 0, 7, new_epoch) is True
    assert tracker.committable() == {TP: 8}


def test_reset_after_a_rewind_restarts_tracking_and_forgets_the_commit_mark() -> None:
    tracker = OffsetTracker()
    for offset in range(10):
        tracker.track(T, 0, offset)
        tracker.track(T, 1, offset)
    for offset in range(10):
        tracker.done(T, 0, offset)
    tracker.mark_committed({TP: 10})
    tracker.reset(T, 0)
    # After a seek back to 3 the same offsets come again, and their progress is committable again.
    tracker.track(T, 0, 3)
    tracker.track(T, 0, 4)
    tracker.done(T, 0, 3)
    assert tracker.committable() == {TP: 4}
    assert tracker.in_flight(T, 1) == 10  # the other partition is untouched


def test_in_flight_counts_tracked_but_not_done() -> None:
    tracker = OffsetTracker()
    for offset in range(3):
        tracker.track(T, 0, offset)
        tracker.track(T, 1, offset)
        tracker.track("other", 0, offset)
    tracker.done(T, 0, 2)
    tracker.done("other", 0, 0)
    assert tracker.in_flight() == 7
    assert tracker.in_flight(T) == 5
    assert tracker.in_flight(T, 0) == 2
    assert tracker.in_flight(partition=0) == 4


def test_batch_track_and_done_match_the_single_calls() -> None:
    tracker = OffsetTracker()
    epoch = tracker.track_many(T, 0, [3, 4, 6, 9])
    assert tracker.track(T, 0, 10) == epoch
    tracker.done_many(T, 0, [4, 9, 3])
    assert tracker.committable() == {TP: 5}
    tracker.done_many(T, 0, [6, 10], epoch)
    assert tracker.committable() == {TP: 11}
    assert tracker.in_flight() == 0


@pytest.mark.parametrize("batch", [[5, 4], [6, 6], [2, 7], [7, 8, 8]])
def test_a_batch_that_does_not_increase_is_refused_whole(batch: list[int]) -> None:
    tracker = OffsetTracker()
    tracker.track(T, 0, 2)
    with pytest.raises(ValueError, match="must increase"):
        tracker.track_many(T, 0, batch)
    assert tracker.in_flight() == 1
    tracker.track(T, 0, 3)  # state unchanged: 3 still follows 2


def test_a_batch_with_an_unknown_offset_marks_nothing() -> None:
    tracker = OffsetTracker()
    epoch = tracker.track_many(T, 0, [0, 1, 2])
    with pytest.raises(ValueError, match=r"\[5\]"):
        tracker.done_many(T, 0, [0, 5])
    assert tracker.in_flight() == 3
    assert tracker.committable() == {}
    tracker.drop([TP])
    assert tracker.done_many(T, 0, [0], epoch) is False


def test_done_tracked_finishes_a_whole_batch_and_falls_back_when_older_work_is_in_flight() -> None:
    tracker = OffsetTracker()
    epoch = tracker.track_many(T, 0, [3, 4, 6])
    assert tracker.done_tracked(T, 0, [3, 4, 6], epoch)
    assert (tracker.committable(), tracker.in_flight()) == ({TP: 7}, 0)
    # A record of an earlier batch (a poison one waiting for its dead-letter write) is still in flight:
    # the next batch's completion must not move the commit past it.
    tracker.track(T, 0, 7)
    epoch = tracker.track_many(T, 0, [8, 9])
    assert tracker.done_tracked(T, 0, [8, 9], epoch)
    assert (tracker.committable(), tracker.in_flight()) == ({TP: 7}, 1)
    tracker.done(T, 0, 7)
    assert tracker.committable() == {TP: 10}
    # Stale after a drop, and an unknown offset is refused as done_many() refuses it.
    epoch = tracker.track_many(T, 0, [10, 11])
    with pytest.raises(ValueError, match=r"\[12\]"):
        tracker.done_tracked(T, 0, [10, 12], epoch)
    tracker.drop([TP])
    assert tracker.done_tracked(T, 0, [10, 11], epoch) is False


def test_done_through_finishes_a_handled_batch_but_waits_behind_older_work() -> None:
    tracker = OffsetTracker()
    tracker.done_through(T, 0, 6)
    assert (tracker.committable(), tracker.in_flight()) == ({TP: 7}, 0)
    # A poison record of an earlier batch is still in flight: the handled batch must not pass it.
    tracker.track(T, 0, 7)
    tracker.done_through(T, 0, 9)
    assert (tracker.committable(), tracker.in_flight()) == ({TP: 7}, 1)
    tracker.done(T, 0, 7)
    assert tracker.committable() == {TP: 10}
    # A rewind (nothing after the last tracked offset) is refused, as track_many() refuses it.
    with pytest.raises(ValueError, match="offsets must increase"):
        tracker.done_through(T, 0, 9)
    tracker.reset(T, 0)
    tracker.done_through(T, 0, 5)
    assert tracker.committable() == {TP: 6}


def test_concurrent_completions_from_worker_threads() -> None:
    """The poll thread tracks while 6 workers complete out of order; no update is lost."""
    tracker = OffsetTracker()
    partitions = 3
    per_partition = 20_000
    work: queue.Queue[tuple[int, int, int] | None] = queue.Queue()
    observed: list[dict[TopicPartition, int]] = []
    refused: list[tuple[int, int]] = []

    def finish(batch: list[tuple[int, int, int]]) -> None:
        for partition, offset, epoch in batch:
            if not tracker.done(T, partition, offset, epoch):
                refused.append((partition, offset))
        batch.clear()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        batch: list[tuple[int, int, int]] = []
        while (item := work.get()) is not None:
            batch.append(item)
            if len(batch) >= rng.randint(1, 50):  # finish in a scrambled order
                rng.shuffle(batch)
                finish(batch)
        finish(batch)

    def committer() -> None:
        while not stop.wait(0.001):
            offsets = tracker.committable()
            observed.append(offsets)
            tracker.mark_committed(offsets)

    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    threads.append(threading.Thread(target=committer))
    for thread in threads:
        thread.start()
    for offset in range(per_partition):
        for partition in range(partitions):
            work.put((partition, offset * 2, tracker.track(T, partition, offset * 2)))  # odd ones: holes
    for _ in range(6):
        work.put(None)
    for thread in threads[:-1]:
        thread.join(timeout=60)
    stop.set()
    threads[-1].join(timeout=60)

    assert refused == []
    assert tracker.in_flight() == 0
    final = {tp: value for offsets in observed for tp, value in offsets.items()}
    final.update(tracker.committable())
    assert final == {(T, p): 2 * (per_partition - 1) + 1 for p in range(partitions)}
    for partition in range(partitions):  # each commit moved forward, never back
        values = [o[(T, partition)] for o in observed if (T, partition) in o]
        assert values == sorted(set(values))


def _expected_committable(tracked: list[int], finished: set[int]) -> int | None:
    """The contract, computed the slow obvious way: last offset of the all-done prefix, plus one."""
    committable = None
    for offset in tracked:
        if offset not in finished:
            break
        committable = offset + 1
    return committable


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=60),
    start=st.integers(min_value=0, max_value=10**12),
    data=st.data(),
)
def test_property_committable_is_the_done_prefix_in_any_completion_order(
    gaps: list[int], start: int, data: st.DataObject
) -> None:
    offsets = []
    offset = start
    for gap in gaps:  # gaps > 1 are holes left by compaction or transaction markers
        offsets.append(offset)
        offset += gap
    order = data.draw(st.permutations(offsets))
    tracker = OffsetTracker()
    for offset in offsets:
        tracker.track(T, 0, offset)
    finished: set[int] = set()
    for offset in order:
        tracker.done(T, 0, offset)
        finished.add(offset)
        expected = _expected_committable(offsets, finished)
        assert tracker.committable().get(TP) == expected
    assert tracker.committable() == {TP: offsets[-1] + 1}


class TrackerMachine(RuleBasedStateMachine):
    """Random deliveries with holes, completions in any order, commits, drops and rewinds."""

    partitions = (("a", 0), ("a", 1), ("b", 0))

    @initialize()
    def start(self) -> None:
        self.tracker = OffsetTracker()
        self.tracked: dict[TopicPartition, list[int]] = {tp: [] for tp in self.partitions}
        self.finished: dict[TopicPartition, set[int]] = {tp: set() for tp in self.partitions}
        self.epochs: dict[TopicPartition, int] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.next_offset = dict.fromkeys(self.partitions, 0)
        self.stale: list[tuple[TopicPartition, int, int]] = []  # records held by workers when lost

    def _pending(self) -> list[tuple[TopicPartition, int]]:
        return [(tp, o) for tp in self.partitions for o in self.tracked[tp] if o not in self.finished[tp]]

    @rule(tp=st.sampled_from(partitions), hole=st.integers(min_value=0, max_value=3))
    def deliver(self, tp: TopicPartition, hole: int) -> None:
        offset = self.next_offset[tp] + hole
        self.epochs[tp] = self.tracker.track(tp[0], tp[1], offset)
        self.tracked[tp].append(offset)
        self.next_offset[tp] = offset + 1

    @rule(tp=st.sampled_from(partitions), holes=st.lists(st.integers(min_value=0, max_value=3), max_size=8))
    def deliver_batch(self, tp: TopicPartition, holes: list[int]) -> None:
        offsets = []
        for hole in holes:
            offsets.append(self.next_offset[tp] + hole)
            self.next_offset[tp] = offsets[-1] + 1
        self.epochs[tp] = self.tracker.track_many(tp[0], tp[1], offsets)
        self.tracked[tp].extend(offsets)

    @rule(tp=st.sampled_from(partitions), holes=st.lists(st.integers(min_value=0, max_value=3), min_size=1,
                                                          max_size=8))
    def deliver_handled_batch(self, tp: TopicPartition, holes: list[int]) -> None:
        """The consumer's hot path: a batch handled whole before it is tracked (done_through)."""
        offsets = []
        for hole in holes:
            offsets.append(self.next_offset[tp] + hole)
            self.next_offset[tp] = offsets[-1] + 1
        self.tracker.done_through(tp[0], tp[1], offsets[-1])
        self.tracked[tp].extend(offsets)
        self.finished[tp].update(offsets)

    @precondition(lambda self: bool(self._pending()))
    @rule(data=st.data(), with_epoch=st.booleans())
    def finish(self, data: st.DataObject, with_epoch: bool) -> None:
        tp, offset = data.draw(st.sampled_from(self._pending()))
        epoch = self.epochs[tp] if with_epoch else None
        assert self.tracker.done(tp[0], tp[1], offset, epoch) is True
        self.finished[tp].add(offset)

    @precondition(lambda self: bool(self._pending()))
    @rule(data=st.data())
    def finish_batch(self, data: st.DataObject) -> None:
        tp = data.draw(st.sampled_from(sorted({tp for tp, _ in self._pending()})))
        pending = [o for o in self.tracked[tp] if o not in self.finished[tp]]
        offsets = data.draw(st.lists(st.sampled_from(pending), min_size=1, unique=True))
        assert self.tracker.done_many(tp[0], tp[1], offsets, self.epochs[tp]) is True
        self.finished[tp].update(offsets)

    @precondition(lambda self: bool(self.stale))
    @rule(data=st.data())
    def late_completion(self, data: st.DataObject) -> None:
        """A worker finishes a record of a partition that was lost (and maybe assigned again) since."""
        tp, offset, epoch = data.draw(st.sampled_from(self.stale))
        assert self.tracker.done(tp[0], tp[1], offset, epoch) is False

    @rule()
    def commit(self) -> None:
        offsets = self.tracker.committable()
        self.tracker.mark_committed(offsets)
        self.committed.update(offsets)

    @rule(tp=st.sampled_from(partitions), rewind=st.booleans())
    def lose(self, tp: TopicPartition, rewind: bool) -> None:
        """A revoke/loss (drop) or a seek (reset); a worker still holding an old record finishes late."""
        late = next((o for o in self.tracked[tp] if o not in self.finished[tp]), None)
        if late is not None:
            self.stale.append((tp, late, self.epochs[tp]))
        if rewind:
            self.tracker.reset(*tp)
        else:
            self.tracker.drop([tp])
        if late is not None:
            assert self.tracker.done(tp[0], tp[1], late, self.epochs[tp]) is False
        self.tracked[tp], self.finished[tp] = [], set()
        self.committed.pop(tp, None)
        if rewind and self.next_offset[tp] > 0:
            self.next_offset[tp] = self.next_offset[tp] // 2  # seek back: offsets are delivered again

    @invariant()
    def committable_is_exactly_the_done_prefix(self) -> None:
        offsets = self.tracker.committable()
        for tp in self.partitions:
            expected = _expected_committable(self.tracked[tp], self.finished[tp])
            if expected is not None and expected > self.committed.get(tp, -1):
                assert offsets.get(tp) == expected
            else:
                assert tp not in offsets
            if tp in offsets:  # the guarantee itself: nothing below it is unfinished
                assert all(o in self.finished[tp] for o in self.tracked[tp] if o < offsets[tp])

    @invariant()
    def in_flight_counts_unfinished(self) -> None:
        assert self.tracker.in_flight() == len(self._pending())

    @rule()
    def finish_everything(self) -> None:
        for tp, offset in self._pending():
            self.tracker.done(tp[0], tp[1], offset)
            self.finished[tp].add(offset)
        offsets = self.tracker.committable()
        for tp in self.partitions:
            if self.tracked[tp]:
                last_plus_one = self.tracked[tp][-1] + 1
                assert offsets.get(tp, self.committed.get(tp)) == last_plus_one


TrackerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=50, deadline=None)
test_tracker_state_machine = TrackerMachine.TestCase
