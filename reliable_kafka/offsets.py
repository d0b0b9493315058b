"""Per-partition tracker of processed offsets: which offset the consumer may commit.

Guarantee: a partition's committable offset is (highest offset O such that O and every earlier offset
handed to the application on that partition are done) + 1, so a commit never passes unfinished work.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

TopicPartition = tuple[str, int]


class _Partition:
    """What one partition handed out and got back since it was assigned (or last rewound)."""

    __slots__ = ("epoch", "unreleased", "in_flight", "last_tracked", "committable", "committed", "closing")

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        # Tracked offsets from the oldest one not yet done, in delivery order. Offsets are not
        # contiguous integers (compaction, transaction markers), so we keep the real ones.
        self.unreleased: deque[int] = deque()
        self.in_flight: set[int] = set()  # tracked, not done yet
        self.last_tracked = -1
        self.committable: int | None = None  # next offset to consume, as Kafka commits it
        self.committed: int | None = None  # the last value passed to mark_committed
        self.closing = False  # about to be released: records not started yet are not to start (stop_starting)

    def release(self) -> None:
        """Move `committable` past the done prefix of `unreleased`; each offset is released once."""
        unreleased, in_flight = self.unreleased, self.in_flight
        if not in_flight and unreleased:  # everything handed out is done: skip the walk
            self.committable = unreleased[-1] + 1
            unreleased.clear()
            return
        released = None
        while unreleased and unreleased[0] not in in_flight:
            released = unreleased.popleft()
        if released is not None:
            self.committable = released + 1


def _not_increasing(topic: str, partition: int, offset: int, last: int) -> ValueError:
    return ValueError(
        f"{topic}[{partition}] offset {offset} tracked after {last}: offsets must increase per "
        "partition (call reset() after a seek or rewind)"
    )


def _not_in_flight(topic: str, partition: int, offsets: Iterable[int]) -> ValueError:
    shown = sorted(offsets)[:5]
    return ValueError(
        f"{topic}[{partition}] offset(s) {shown} not in flight: never tracked, already done, or the "
        "partition was dropped/reset since (pass the epoch from track() to ignore stale completions)"
    )


class OffsetTracker:
    """Tracks offsets delivered to the application and offsets it finished, per partition.

    The poll loop calls `track()` for every record it hands out (offsets increase per partition);
    handler threads call `done()` in any order. `committable()` gives the next-offsets that are safe
    to commit and moved since the last `mark_committed()`. `track_many()`/`done_many()` do the same
    for a batch of one partition under one lock, for the consume()-a-batch fast path.

    Each partition's state has an epoch, returned by `track()`. A worker that finishes a record after
    its partition was dropped or reset passes that epoch to `done()`, and is ignored instead of marking
    a redelivered record with the same offset as done. Thread-safe; every call is amortised O(1) per
    offset (committable/in_flight: O(partitions)).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._epochs = itertools.count(1)

    def _open(self, key: TopicPartition) -> _Partition:
        part = self._partitions[key] = _Partition(next(self._epochs))
        return part

    # The per-message methods use acquire/release rather than `with`: they run once per record, and
    # the context-manager protocol costs about as much as the tracking itself.

    def track(self, topic: str, partition: int, offset: int) -> int:
        """Record that `offset` was handed to the application; returns the partition's epoch.

        Raises ValueError if the offset does not increase: after a seek or rewind call `reset()` first.
        """
        key = (topic, partition)
        self._lock.acquire()
        try:
            part = self._partitions.get(key)
            if part is None:
                part = self._open(key)
            if offset <= part.last_tracked:
                raise _not_increasing(topic, partition, offset, part.last_tracked)
            # in_flight first: an offset must never sit in `unreleased` looking done.
            part.in_flight.add(offset)
            part.unreleased.append(offset)
            part.last_tracked = offset
            return part.epoch
        finally:
            self._lock.release()

    def track_many(self, topic: str, partition: int, offsets: Sequence[int]) -> int:
        """`track()` for increasing offsets of one partition at once; returns the partition's epoch."""
        key = (topic, partition)
        with self._lock:
            part = self._partitions.get(key)
            if part is None:
                part = self._open(key)
            if not offsets:
                return part.epoch
            previous = part.last_tracked
            # Checked pairwise in C (map/operator.lt); the Python loop only runs to name the culprit.
            increasing = all(map(operator.lt, offsets, itertools.islice(offsets, 1, None)))
            if offsets[0] <= previous or not increasing:
                for last, offset in itertools.pairwise([previous, *offsets]):
                    if offset <= last:
                        raise _not_increasing(topic, partition, offset, last)
            part.in_flight.update(offsets)
            part.unreleased.extend(offsets)
            part.last_tracked = offsets[-1]
            return part.epoch

    def done(self, topic: str, partition: int, offset: int, epoch: int | None = None) -> bool:
        """Record that the application finished `offset`; returns False if the completion is stale.

        With `epoch` (from `track()`), a completion for a partition that was dropped or reset since is
        stale and ignored. Otherwise an offset that is not in flight (never tracked, already done, or
        forgotten) raises ValueError: accepting it could let a commit pass unfinished work.
        """
        self._lock.acquire()
        try:
            part = self._partitions.get((topic, partition))
            if epoch is not None and (part is None or part.epoch != epoch):
                return False
            if part is None or offset not in part.in_flight:
                raise _not_in_flight(topic, partition, (offset,))
            in_flight = part.in_flight
            in_flight.remove(offset)
            unreleased = part.unreleased
            if unreleased[0] == offset:
                # Same loop as _Partition.release(), inlined: a method call here costs ~30% of done().
                released = unreleased.popleft()
                while unreleased and unreleased[0] not in in_flight:
                    released = unreleased.popleft()
                part.committable = released + 1
            return True
        finally:
            self._lock.release()

    def done_many(self, topic: str, partition: int, offsets: Iterable[int], epoch: int | None = None) -> bool:
        """`done()` for several offsets of one partition, all or none (ValueError if one is unknown)."""
        finished = set(offsets)
        with self._lock:
            part = self._partitions.get((topic, partition))
            if epoch is not None and (part is None or part.epoch != epoch):
                return False
            if part is None or not part.in_flight.issuperset(finished):
                raise _not_in_flight(topic, partition, finished - (part.in_flight if part else set()))
            part.in_flight.difference_update(finished)
            part.release()
            return True

    def done_tracked(self, topic: str, partition: int, offsets: Sequence[int], epoch: int) -> bool:
        """`done_many()` for exactly the offsets of this partition's last `track_many()` call (the
        consume-a-batch path, after every record of the batch was handled).

        When they are all that is in flight, the partition is simply done up to the last one, with
        one pass over the batch instead of done_many()'s three (building a set of it, comparing,
        subtracting). Otherwise (an older record still in flight, say) it is done_many().
        """
        with self._lock:
            part = self._partitions.get((topic, partition))
            if part is None or part.epoch != epoch:
                return False
            in_flight = part.in_flight
            # Same size and all of them in it: the in-flight set is exactly these offsets, so
            # `unreleased` holds just them (the done ones before them were released when done).
            if offsets and len(in_flight) == len(offsets) and in_flight.issuperset(offsets):
                in_flight.clear()
                part.unreleased.clear()
                part.committable = offsets[-1] + 1
                return True
        return self.done_many(topic, partition, offsets, epoch)

    def done_through(self, topic: str, partition: int, last: int) -> None:
        """Every record of this partition up to `last` that was handed out is done (a batch handled
        before it was tracked). The partition becomes committable up to `last` + 1, unless an older
        record is still in flight: then `last` waits behind it, as done_many() would leave it.

        Raises ValueError if `last` is not after everything tracked before (a rewind). A batch that
        only overlaps what was tracked before is accepted: all of it was handled, some of it twice.
        """
        with self._lock:
            key = (topic, partition)
            part = self._partitions.get(key)
            if part is None:
                part = self._open(key)
            if last <= part.last_tracked:
                raise _not_increasing(topic, partition, last, part.last_tracked)
            part.last_tracked = last
            if part.in_flight:
                # Only `last` stands for the batch: release() moves committable to last + 1 once the
                # older in-flight records are done.
                part.unreleased.append(last)
            else:
                part.unreleased.clear()
                part.committable = last + 1

    def committable(self) -> dict[TopicPartition, int]:
        """Next-offsets safe to commit, for partitions that moved past their last mark_committed()."""
        with self._lock:
            return {
                key: part.committable
                for key, part in self._partitions.items()
                if part.committable is not None
                and (part.committed is None or part.committable > part.committed)
            }

    def committed(self) -> dict[TopicPartition, int]:
        """The last next-offset Kafka confirmed committed, per partition held that has one."""
        with self._lock:
            return {key: part.committed for key, part in self._partitions.items() if part.committed is not None}

    def mark_committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Record that Kafka acknowledged a commit of these next-offsets; partitions not held are ignored."""
        with self._lock:
            for key, offset in offsets.items():
                part = self._partitions.get(key)
                if part is not None and (part.committed is None or offset > part.committed):
                    part.committed = offset

    def mark_landed(self, offsets: Mapping[TopicPartition, int]) -> bool:
        """Record that a commit of these next-offsets was the last to land, even if it is older than
        one confirmed before (the group keeps the last write, not the highest). Returns True if some
        partition went back: committable() offers its newer offset again."""
        went_back = False
        with self._lock:
            for key, offset in offsets.items():
                part = self._partitions.get(key)
                if part is None:
                    continue
                went_back |= part.committed is not None and offset < part.committed
                part.committed = offset
        return went_back

    def drop(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget revoked or lost partitions: staged offsets are discarded and their epochs become stale."""
        with self._lock:
            for key in partitions:
                self._partitions.pop(key, None)

    def may_start(self, topic: str | None, partition: int | None, epoch: int) -> bool:
        """Whether a record tracked with this epoch (from track()) may still start: its partition was neither
        dropped nor reset since, nor is it about to be (stop_starting). No lock: a dict read and two attribute
        reads, each atomic, once per record on the workers. Takes what Message.topic()/partition() return."""
        part = self._partitions.get((topic, partition))  # type: ignore[arg-type]  # None finds nothing
        return part is not None and part.epoch == epoch and not part.closing

    def stop_starting(self, partitions: Iterable[TopicPartition]) -> None:
        """Partitions about to be released: their records not started yet may not start (may_start), those
        running may still finish and count as done until drop()."""
        with self._lock:
            for key in partitions:
                part = self._partitions.get(key)
                if part is not None:
                    part.closing = True

    def reset(self, topic: str, partition: int) -> None:
        """Forget a partition the consumer seeked or rewound; tracking restarts with the next delivery."""
        self.drop([(topic, partition)])

    def in_flight(self, topic: str | None = None, partition: int | None = None) -> int:
        """How many tracked offsets are not done, over all partitions or those matching topic/partition."""
        with self._lock:
            return sum(
                len(part.in_flight)
                for (t, p), part in self._partitions.items()
                if (topic is None or t == topic) and (partition is None or p == partition)
            )
