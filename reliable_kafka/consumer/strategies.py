"""Processing strategies: how fetched records reach the handler, chosen once when run() starts.

Guarantee: every strategy completes a record only after its handler (or the DLQ) finished with it, and
keeps each partition's records in order (across workers or lanes: all records of one key go to one).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import zlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from confluent_kafka import Message

from reliable_kafka import telemetry
from reliable_kafka.consumer.commits import CommitCoordinator, Partitions
from reliable_kafka.consumer.dedup_stage import DedupStage
from reliable_kafka.consumer.failures import FailureStages, Offload
from reliable_kafka.consumer.fetcher import Fetcher
from reliable_kafka.consumer.work import AsyncHandler, BatchHandler, Handler, Work
from reliable_kafka.stats import Counters

log = logging.getLogger(__name__)


class RecordStrategy:
    """One thread, one handler call per record, each through the failure stages (the general path)."""

    def __init__(self, handler: Handler, fetcher: Fetcher, failures: FailureStages,
                 commits: CommitCoordinator) -> None:
        self.handler = handler
        self._fetcher = fetcher
        self._failures = failures
        self._commits = commits

    def handle_fetched(self, msgs: list[Message]) -> None:
        """A batch as consume() returned it: tracked first, then handled."""
        msgs = self._fetcher.track(msgs) if msgs else msgs
        if msgs:
            self.handle([self._fetcher.work(m) for m in msgs])

    def handle(self, works: list[Work]) -> None:
        """Tracked records (fresh, or held back earlier)."""
        for w in works:
            self._failures.process(self.handler, w)

    def wait_idle(self, timeout: float, partitions: Partitions | None = None) -> bool:
        """Nothing runs off the loop thread: only confirmations can be pending."""
        self._commits.confirm_handled()
        return True

    def close(self, timeout: float) -> None:
        self.wait_idle(timeout)


class FastStrategy(RecordStrategy):
    """The hot path: one thread, a record handler, no dedup, no tracing."""

    def __init__(self, handler: Handler, fetcher: Fetcher, failures: FailureStages,
                 commits: CommitCoordinator, counters: Counters, single_topic: str | None) -> None:
        super().__init__(handler, fetcher, failures, commits)
        self._counters = counters
        self._tracker = commits.tracker
        # Subscribed to one topic by name (not a ^regex): every record's topic is known without asking.
        self._single_topic = single_topic

    def handle_fetched(self, msgs: list[Message]) -> None:
        """Handle the batch first, then track it as handed out and done in one C-level pass per batch.

        Tracking after handling is safe here: rebalance callbacks run only inside consume(), on this
        thread, so no partition can be revoked between the fetch and the tracking, and nothing is
        committed in between. Anything unusual — an error event in the batch, a handler that raises —
        takes the general path: the whole batch is tracked first, as Fetcher.fetch() does, and the
        records not yet handled go through _run_each() (retries, DLQ or hold).
        """
        if not msgs:
            return
        if any(map(Message.error, msgs)):
            msgs = self._fetcher.track(msgs)
            if msgs:
                self._run_each(msgs)
            return
        handler = self.handler
        failed_at = None
        try:
            for msg in msgs:
                handler(msg)
        except BaseException as exc:
            failed_at = next(i for i, m in enumerate(msgs) if m is msg)  # the record that raised
            first_error = exc
        if failed_at is None:
            # Per partition, the batch's last offset (dict() keeps the last value per key; offsets
            # increase per partition in delivery order).
            done_through = self._tracker.done_through
            if self._single_topic is not None:
                # One topic: partitions (small ints, cheap to hash) are the keys. A batch is usually
                # cut from one fetch response, so usually all of one partition: then its last record
                # is all there is to know.
                topic = self._single_topic
                first, last = msgs[0], msgs[-1]
                partition, upto = last.partition(), last.offset()
                if first.partition() == partition and upto - first.offset() == len(msgs) - 1:  # type: ignore[operator]
                    # First and last of one partition, offsets without a gap: all of it, in the usual
                    # case, found in O(1) (the exact pass below costs ~35 ns a record, ~3% of the
                    # consumer's time here). Should another partition's records sit inside a gap of
                    # this one's offsets (transaction markers) they are not lost, only not advanced
                    # now: done_through() marks nothing that was not handled, and their partition
                    # advances with the next batch that ends in it or is mixed.
                    done_through(topic, partition, upto)  # type: ignore[arg-type]
                else:
                    parts = list(map(Message.partition, msgs))
                    for part, last_offset in dict(zip(parts, map(Message.offset, msgs), strict=True)).items():
                        done_through(topic, part, last_offset)  # type: ignore[arg-type]
            else:
                offsets = map(Message.offset, msgs)
                keys = zip(map(Message.topic, msgs), map(Message.partition, msgs), strict=True)
                for (t, part), last_offset in dict(zip(keys, offsets, strict=True)).items():
                    done_through(t, part, last_offset)  # type: ignore[arg-type]
            self._counters.add("handled", len(msgs))
            self._commits.processed(len(msgs))
            # Counted here, once per batch: this path never calls Fetcher.track(), which counts the others.
            telemetry.consumed_messages.add(len(msgs), self._fetcher.consumed_attrs)
            return
        # Handled up to failed_at: track the whole batch, complete what was handled, go on from there.
        self._fetcher.track(msgs)
        if failed_at:
            self._commits.done_all([self._fetcher.work(m) for m in msgs[:failed_at]])
            self._counters.add("handled", failed_at)
        self._run_each(msgs[failed_at:], first_error)

    def _run_each(self, msgs: list[Message], first_error: BaseException | None = None) -> None:
        """Each record's first attempt runs bare and the completions reach the tracker in bulk, per
        partition, reusing the grouping Fetcher.track() made; a record that fails goes on through the
        failure stages (retries, DLQ or hold), which complete it themselves."""
        handler, epochs, fetched = self.handler, self._fetcher.epochs, self._fetcher.fetched
        failed: list[Message] = []
        finished_all = False
        i = 0
        try:
            for i, msg in enumerate(msgs):  # noqa: B007 (i is read in the finally block)
                try:
                    if first_error is not None:  # the first record's first attempt was made by handle_fetched()
                        exc, first_error = first_error, None
                        raise exc
                    handler(msg)
                except BaseException as exc:
                    failed.append(msg)
                    self._failures.process(handler, self._fetcher.work(msg), first_error=exc)
            finished_all = True
        finally:
            if finished_all and not failed:
                finished = fetched
            else:
                # Left early (an exception from the failure stages, say): record i and the ones after
                # it are not finished. Failed records were completed, or held, by the stages themselves.
                upto = len(msgs) if finished_all else i
                skip = {id(m) for m in failed}
                finished = defaultdict(list)
                for m in msgs[:upto]:
                    if id(m) not in skip:
                        finished[(m.topic(), m.partition())].append(m.offset())  # type: ignore[index,arg-type]
            handled = 0
            complete = self._tracker.done_tracked if finished is fetched else self._tracker.done_many
            for (topic, partition), offsets in finished.items():
                complete(topic, partition, offsets, epochs[(topic, partition)])
                handled += len(offsets)
            self._counters.add("handled", handled)
            self._commits.processed(handled)


class BatchStrategy(RecordStrategy):
    """One thread, a batch handler: the whole batch per call; on failure, record by record."""

    def __init__(self, batch_handler: BatchHandler, fetcher: Fetcher, failures: FailureStages,
                 commits: CommitCoordinator) -> None:
        super().__init__(_one_by_one(batch_handler), fetcher, failures, commits)
        self._batch_handler = batch_handler

    def handle(self, works: list[Work]) -> None:
        if len(works) > 1:
            self._failures.process_batch(self._batch_handler, self.handler, works)
        else:
            super().handle(works)


class ConcurrentStrategy(RecordStrategy):
    """`concurrency` worker threads; records of one key (or, without a key, one partition) share one."""

    def __init__(self, handler: Handler, concurrency: int, fetcher: Fetcher, failures: FailureStages,
                 commits: CommitCoordinator) -> None:
        super().__init__(handler, fetcher, failures, commits)
        self._queues: list[queue.Queue[Work | None]] = []
        self._workers: list[threading.Thread] = []
        for i in range(concurrency):
            q: queue.Queue[Work | None] = queue.Queue()
            t = threading.Thread(target=self._work, args=(q,), name=f"reliable-kafka-worker-{i}", daemon=True)
            self._queues.append(q)
            self._workers.append(t)
            t.start()

    def handle(self, works: list[Work]) -> None:
        queues, n = self._queues, len(self._queues)
        for w in works:
            queues[lane_of(w.msg, n)].put(w)

    def _work(self, q: queue.Queue[Work | None]) -> None:
        may_start = self._commits.tracker.may_start
        while True:
            w = q.get()
            if w is None:
                return
            try:
                if not may_start(w.msg.topic(), w.msg.partition(), w.epoch):  # see LoopStrategy._lane
                    self._failures.left_for_new_owner([w])
                    continue
                self._failures.process(self.handler, w)
            except Exception:
                log.exception("worker failed on a record; it stays uncommitted and will be redelivered")

    def wait_idle(self, timeout: float, partitions: Partitions | None = None) -> bool:
        """Wait until the workers finished what is in flight (of `partitions`, or all but stuck records)."""
        return _wait_idle(self._commits, self._failures, self._fetcher, timeout, partitions)

    def close(self, timeout: float) -> None:
        """Graceful stop: let the workers finish in-flight records, then end them."""
        self.wait_idle(timeout)
        for q in self._queues:
            q.put(None)
        for t in self._workers:
            t.join(timeout=timeout)


class LoopStrategy(RecordStrategy):
    """Hands fetched records to an event loop, where `concurrency` lanes (tasks) run an async handler.

    The fetch thread calls handle() (one hand-over to the loop per batch); records of one key (or,
    without a key, one partition) share a lane, as ConcurrentStrategy's workers do, so they run one
    after the other in offset order. Each record goes through FailureStages.process_async(); what may
    block (a dead-letter write) runs on `offload`'s threads, never on the loop.
    """

    def __init__(self, handler: AsyncHandler, concurrency: int, loop: asyncio.AbstractEventLoop,
                 stop: asyncio.Event, offload: Offload, fetcher: Fetcher, failures: FailureStages,
                 commits: CommitCoordinator, stop_consumer: Callable[[], None] = lambda: None) -> None:
        super().__init__(handler, fetcher, failures, commits)
        self._async_handler = handler
        self._loop = loop
        self._stop = stop  # set by stop(): cuts retry backoffs short
        self._stop_consumer = stop_consumer  # what a lane calls when the process is stopping under it
        self._offload = offload
        self._lanes: list[asyncio.Queue[Work]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._concurrency = concurrency
        self.failed: BaseException | None = None  # a BaseException a handler raised (not retried): run() raises it

    def start(self) -> None:
        """(On the loop.) Start the lanes."""
        for i in range(self._concurrency):
            q: asyncio.Queue[Work] = asyncio.Queue()
            self._lanes.append(q)
            self._tasks.append(self._loop.create_task(self._lane(q), name=f"reliable-kafka-lane-{i}"))

    def handle(self, works: list[Work]) -> None:
        """(On the fetch thread.) Tracked records, to the loop in one hand-over."""
        if works:
            self._loop.call_soon_threadsafe(self._dispatch, works)

    def _dispatch(self, works: list[Work]) -> None:
        lanes, n = self._lanes, len(self._lanes)
        for w in works:
            lanes[lane_of(w.msg, n)].put_nowait(w)

    async def _lane(self, q: asyncio.Queue[Work]) -> None:
        process, handler, stop, offload = self._failures.process_async, self._async_handler, self._stop, self._offload
        may_start = self._commits.tracker.may_start
        while True:
            w = await q.get()
            try:
                if not may_start(w.msg.topic(), w.msg.partition(), w.epoch):
                    # Its partition was released (lost), or is about to be by a revoke that gave up waiting,
                    # while the record waited in the lane: the new owner runs it; here too would repeat it.
                    await offload(self._failures.left_for_new_owner, [w])
                    continue
                await process(handler, w, stop=stop, offload=offload)
            except Exception:
                log.exception("lane failed on a record; it stays uncommitted and will be redelivered")
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # KeyboardInterrupt, SystemExit from a handler: the process stopping
                self.failed = exc
                self._stop_consumer()
                return

    def wait_idle(self, timeout: float, partitions: Partitions | None = None) -> bool:
        """(On the fetch thread.) Wait until the lanes finished what is in flight (of `partitions`, or all
        but stuck records)."""
        return _wait_idle(self._commits, self._failures, self._fetcher, timeout, partitions,
                          lambda: self.failed is not None)

    async def cancel(self) -> None:
        """(On the loop.) End the lanes: a handler still running is cancelled, its record stays unfinished
        (in flight, never committed) and is delivered again to the partition's next owner."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class ClaimedStrategy:
    """Dedup in front of another strategy: each batch's keys are claimed first; duplicates are skipped.

    With one thread, a record handler and no tracing (`bare=True`) the claimed records run as the hot
    path does: first attempts bare, then one confirm call and one tracker call per partition for the lot.
    """

    def __init__(self, inner: RecordStrategy, dedup: DedupStage, *, bare: bool, fetcher: Fetcher,
                 failures: FailureStages, commits: CommitCoordinator, counters: Counters) -> None:
        self._inner = inner
        self._dedup = dedup
        self._bare = bare
        self._fetcher = fetcher
        self._failures = failures
        self._commits = commits
        self._counters = counters

    def handle_fetched(self, msgs: list[Message]) -> None:
        msgs = self._fetcher.track(msgs) if msgs else msgs
        if msgs:
            self.handle([self._fetcher.work(m) for m in msgs])

    def handle(self, works: list[Work]) -> None:
        claimed = self._dedup.claim(works)
        if claimed is None:  # the store is unavailable
            if self._dedup.fail_open:
                self._inner.handle(works)
            else:
                # Fail closed: nothing of the batch runs, so nothing past it is confirmed or committed.
                self._fetcher.hold(works, self._dedup.retry_in_s())
            return
        for w in claimed.duplicates:
            # Confirmed earlier, or a copy of a key that runs in this batch: its effect covers this one.
            self._counters.add("duplicates_skipped")
            telemetry.dedup_hits.add(1)
            self._commits.done(w)
        if self._bare:
            self._run_claimed(claimed.run)
        else:
            self._inner.handle(claimed.run)
        if claimed.later:
            # Behind a busy key: claimed again on the next pass, after a short paused wait.
            self._fetcher.hold(claimed.later, 0.2)

    def wait_idle(self, timeout: float, partitions: Partitions | None = None) -> bool:
        return self._inner.wait_idle(timeout, partitions)

    def close(self, timeout: float) -> None:
        self._inner.close(timeout)

    def _run_claimed(self, works: list[Work]) -> None:
        handler = self._inner.handler
        handled: list[Work] = []
        shut = self._dedup.shut  # partitions fenced off meanwhile (a handler's inbox found out): skip the rest
        try:
            for w in works:
                if shut and (w.msg.topic(), w.msg.partition()) in shut:
                    continue
                try:
                    handler(w.msg)
                except BaseException as exc:
                    self._failures.process(handler, w, first_error=exc)  # it confirms on its own
                    continue
                handled.append(w)
        finally:
            self._counters.add("handled", len(handled))
            self._commits.done_all([w for w in handled if w.key is None])
            self._dedup.confirm_later([w for w in handled if w.key is not None])


def lane_of(msg: Message, n: int) -> int:
    """Which of `n` workers (or lanes) runs `msg`: one per key, or, without a key, one per partition."""
    key = msg.key()
    route = key if key is not None else f"{msg.topic()}/{msg.partition()}".encode()
    return zlib.crc32(route) % n


def _wait_idle(commits: CommitCoordinator, failures: FailureStages, fetcher: Fetcher, timeout: float,
               partitions: Partitions | None, gave_up: Callable[[], bool] = lambda: False) -> bool:
    """Wait until what is in flight (of `partitions`, or all but stuck records) finished elsewhere (on
    workers, on the loop); confirms dedup keys meanwhile, so what finished becomes committable.

    Records the fetcher holds back are not waited for: they run only when the fetch thread hands them
    over, and this wait runs on that thread (a revoke inside consume(), the stop after the last pass).
    Counted, they made the wait last its whole timeout (revoke_timeout_s) for nothing; they stay
    uncommitted and are redelivered."""
    tracker = commits.tracker
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not gave_up():
        commits.confirm_handled()
        if partitions is None:
            busy = tracker.in_flight() - failures.dead_letters.stuck_count() - fetcher.held_count() > 0
        else:
            busy = sum(tracker.in_flight(t, p) for t, p in partitions) - fetcher.held_count(partitions) > 0
        if not busy:
            return True
        time.sleep(0.01)
    return False


def _one_by_one(batch_handler: BatchHandler) -> Handler:
    return lambda msg: batch_handler([msg])


def choose(handler: Handler | BatchHandler, *, batch: bool, concurrency: int, tracing: bool,
           dedup: DedupStage | None, single_topic: str | None, fetcher: Fetcher, failures: FailureStages,
           commits: CommitCoordinator, counters: Counters) -> RecordStrategy | ClaimedStrategy:
    """The strategy for this run(): decided once, not per pass."""
    parts: dict[str, Any] = {"fetcher": fetcher, "failures": failures, "commits": commits}
    record_handler: Handler = _one_by_one(handler) if batch else handler  # type: ignore[arg-type,assignment]
    inner: RecordStrategy
    if concurrency > 1:
        inner = ConcurrentStrategy(record_handler, concurrency, **parts)
    elif batch:
        inner = BatchStrategy(handler, **parts)  # type: ignore[arg-type]
    elif dedup is None and not tracing:
        return FastStrategy(record_handler, counters=counters, single_topic=single_topic, **parts)
    else:
        inner = RecordStrategy(record_handler, **parts)
    if dedup is None:
        return inner
    # One thread runs the records in order: a key's copy in a later batch is checked only after the
    # earlier one was recorded, so the partition fence can replace per-key claims.
    dedup.choose_mode(exclusive=concurrency == 1)
    bare = not batch and concurrency == 1 and not tracing
    return ClaimedStrategy(inner, dedup, bare=bare, counters=counters, **parts)
