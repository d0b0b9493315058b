"""Hands spooled messages to librdkafka in seq order and turns its delivery reports into spool updates.

A message leaves the spool only on a delivery report of success; a retriable failure sends it again,
a permanent one marks it failed, and a fatal idempotence error rebuilds the producer and re-sends the spool.
A refusal for want of a permission (an ACL) keeps the message pending until it is granted (see holds.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer

from reliable_kafka import rdkafka_stats, telemetry
from reliable_kafka.errors import (
    AuthenticationFailed,
    ClusterAuthorizationFailed,
    OutboxFull,
    TopicAuthorizationFailed,
)
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.kafka_errors import Disposition, classify, describe, not_authorized
from reliable_kafka.producer.holds import FIRST_WAIT_S, MAX_WAIT_S, AuthorizationHolds
from reliable_kafka.producer.report_slots import ReportSlots
from reliable_kafka.producer.send_spans import SendSpans
from reliable_kafka.producer.topic_guard import TopicGuard
from reliable_kafka.producer_id import prime_producer_id
from reliable_kafka.spool import NewMessage, OutboxRow, Spool
from reliable_kafka.stats import Counters

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger("reliable_kafka.rdkafka")

_T = TypeVar("_T")

# How many outbox rows the dispatcher reads per page when it re-sends a backlog.
_DISPATCH_PAGE = 2_000
# accept() waits for room in librdkafka only while deliveries keep coming; after this long without
# one (brokers away) it stops waiting and the spool takes the messages on its own.
_STALL_S = 2.0

# What the producer's stats() reports, always all of them (docs/producer.md#stats says what each counts).
STATS = ("sent", "delivered", "failed", "retried", "recreated", "commits")

# Told once per poll round what was settled in it: (delivered seqs, failed seqs), on the poller thread.
DeliveryListener = Callable[[list[int], list[int]], None]


def _acquire_without_queueing(lock: Any) -> None:
    """Take `lock`, held by another sender now, without sleeping in its queue of waiters.

    Why: a thread asleep in a lock's queue is woken by each release and then needs the GIL, so once one
    sender sleeps there every message hands the lock and the GIL from thread to thread (a convoy: 0.6
    context switches a message from 16 threads, 59 % of their samples waiting on the lock). Polling with a
    short, growing sleep leaves no one in the queue: the holder releases and re-takes it without a wake-up.
    The lock is held for microseconds (nothing in it gives up the GIL but a rare segment or settle), so
    the poll rarely runs: 204 of 200,000 sends from 16 threads found it taken.
    """
    delay = 0.0
    while not lock.acquire(False):
        time.sleep(delay)
        delay = min(delay * 2 or 1e-5, 1e-3)


class Dispatcher:
    """Owns the librdkafka producer and its poller thread.

    Order: seqs are handed over in the order they were appended (one lock covers append and hand-over);
    a row that cannot go now (older ones wait, librdkafka is full) is handed over by the poller later.
    Delivery reports only record what happened; everything slow (spool writes, the topic guard's
    admin requests after a size refusal) runs on the poller thread after poll() returns.
    """

    def __init__(self, config: Mapping[str, Any], spool: Spool, guard: TopicGuard, *, max_in_flight: int,
                 send_timeout_s: float, on_failed: Callable[[OutboxRow], None] | None,
                 spans: SendSpans | None = None) -> None:
        """`spans`: the send spans of a producer that traces (None: nothing per message is traced)."""
        self._config = dict(config)
        self._spool = spool
        self._guard = guard
        self._limits = guard.limits  # read per message below: the dict itself, not a call
        self._max_in_flight = max_in_flight
        # Where a send that waited for room (_wait_for_room) still hands its rows over itself. Above
        # max_in_flight: between that wait and the hand-over other senders may have filled librdkafka up
        # to the bound, and a row that found it full went to the spool's backlog, every later row behind
        # it (order), all handed over by the poller alone, on a GIL sixteen senders share, while the
        # senders, spared produce(), appended faster: a trap. 16 threads, 400,000 send()s in "process":
        # 180,730 and 277,607 rows through the backlog, 46,701 and 244,089 still in it when the last
        # send returned; with the ceiling none, and 64,669-73,033 msgs/s against 43,486-47,252
        # (CHANGELOG, "a soft bound for the hand-over").
        self._hand_over_ceiling = max_in_flight + max_in_flight // 4
        self._send_timeout_s = send_timeout_s
        self._on_failed = on_failed
        self._spans = spans
        # librdkafka's statistics as metrics, when the config asks for them and metrics are on.
        self._rdkafka_stats = rdkafka_stats.collector(self._config, "producer")
        # Order of sends is the order of seqs; this lock keeps append + hand-over to librdkafka in that order.
        self._send_lock = threading.RLock()
        self._dispatched_upto = 0  # every pending seq <= this was handed to librdkafka (this generation)
        self._last_seq = 0
        self._redeliver: deque[int] = deque()  # seqs whose delivery failed retriably: hand over again
        self._generation = 0
        self._fatal: KafkaError | None = None
        # Filled by delivery callbacks on the poller thread; one list for the producer's life (the report
        # slots append to it directly), drained by _apply_reports().
        self._delivered: list[int] = []
        self._size_refused: list[tuple[int, str, str]] = []  # (seq, topic, reason): for the guard, off the callback
        self._denied: list[tuple[int, str]] = []  # (seq, topic) refused for want of an ACL, off the callback
        self._holds = AuthorizationHolds()
        self._held = self._holds.by_topic  # send()'s check: a dict's truth is no Python call, __bool__ was
        # A producer rebuilt after its producer id was refused for want of an ACL is refused again at once:
        # the next rebuild waits this long (doubling), and the reason is logged once per streak.
        self._rebuild_wait_s = 0.0
        self._rebuild_at = 0.0
        self._login_refused = False  # said once until a delivery shows the login works again
        self._listener: DeliveryListener | None = None
        # Seqs marked failed since the last poll round, for the listener only. A deque: _fail() runs on
        # the poller and on send()'s threads (a refusal at produce()), and append/popleft are atomic.
        self._failed_now: deque[int] = deque()
        self._settled = threading.Condition()
        self._stop = threading.Event()
        self._last_progress = time.monotonic()  # when a delivery was last confirmed (or the start)
        # Written from send()'s threads and the poller: every name once per batch or per rare event
        # (a failure, a retry, a rebuild), except "sent", see accept().
        self.counters = Counters(STATS)
        # accept_one()'s count, published into the counters and the telemetry counter by publish_sent()
        # (each poll round and each stats()): two counter adds and a metrics call per send() were ~10 %
        # of its CPU (py-spy, one thread against the librdkafka mock), an int increment is not.
        self._sent_one = 0
        self._sent_one_published = 0
        self._producer = self._new_producer()
        # Each message's delivery callback is a slot reused from a pool (report_slots.py: a partial per
        # message kept one tracked object per message in flight, and the collector's work grew with it).
        # With tracing the reports also settle the send spans: a callback chosen here, so that without
        # it no report pays even for the check.
        self._reports = (ReportSlots(self._on_delivery, self._delivered.append) if spans is None
                         else ReportSlots(self._on_delivery_traced))
        # accept_one()'s calls, bound once: a method looked up per send() is a bound-method object made
        # and freed per call (~40 ns each).
        self._take_slot = self._reports.take
        self._append_one = spool.append_one
        self._poller = threading.Thread(target=self._poll_loop, name="reliable-kafka-producer", daemon=True)

    def start(self) -> int:
        """Start the poller; returns how many messages an earlier run left pending (they go out first)."""
        left = 0
        if self._spool.pending(limit=1):
            left = self._spool.stats().pending
            self._last_seq = self._max_pending_seq()
        self._poller.start()
        return left

    def stop(self) -> int:
        """Stop the poller after its final reports; returns how many messages are still pending.

        What librdkafka still holds is let go (the spool keeps it); a newer generation makes the
        purge reports no-ops.
        """
        self._stop.set()
        self._poller.join(timeout=10)
        self._apply_reports()
        remaining = self._spool.stats().pending
        if self._spans is not None:
            self._spans.close()  # before the purge: its reports are no retry of the messages left pending
        if remaining:
            self._generation += 1
            self._producer.purge(in_queue=True, in_flight=True)
            self._producer.poll(0)
        return remaining

    @property
    def in_flight(self) -> int:
        """What librdkafka holds now: messages queued, on the wire or with a report not yet served, and
        events (errors, logs) the poller has not served yet, as len(Producer) counts them."""
        return len(self._producer)

    @property
    def dispatched_upto(self) -> int:
        """The highest seq handed to librdkafka in order (every seq up to it went before it)."""
        return self._dispatched_upto

    def wait_until(self, probe: Callable[[], _T], done: Callable[[_T], bool], timeout: float | None,
                   tick: float) -> _T:
        """Run `probe` after each poll round until `done` says so, the poller stops, or `timeout`;
        returns its last answer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._settled:
            while True:
                value = probe()
                if done(value) or self._stop.is_set():
                    return value
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return value
                self._settled.wait(tick if left is None else min(tick, left))

    # ---- handing messages to librdkafka ---------------------------------------------------

    def accept(self, rows: Sequence[NewMessage], errors: dict[int, str]) -> list[int]:
        """Append `rows` to the spool and hand them to librdkafka unless older ones wait; returns their seqs.

        Fills `errors` (seq -> reason) for rows Kafka refused at once (they are kept as failed). The
        caller passes the dict, and the hand-over loop is inline rather than a method per message: this
        is send's hot path, and a batch costs no call or object beyond what it needs.
        """
        if len(self._producer) >= self._max_in_flight:
            self._wait_for_room()
        return self._append_and_hand_over(rows, errors, self._send_timeout_s)

    def accept_one(self, row: NewMessage) -> tuple[int, str | None]:
        """accept() for one message, send()'s path: (its seq, the reason Kafka refused it at once, or None).

        The same steps as accept() without a batch's lists, zip and error dict, and the send lock taken
        without queueing (see _acquire_without_queueing). One send() in durability "process", one thread,
        on a 3-node local cluster: 13.8 us of the sender's CPU against 19.1 us through accept(); from 16
        threads 16.6 us against 43.1 us (200,000 messages each; CHANGELOG, "One send() per message").
        """
        room = len(self._producer) < self._max_in_flight
        if not room:
            self._wait_for_room()
        lock = self._send_lock
        if not lock.acquire(False):
            _acquire_without_queueing(lock)
        try:
            seq = self._append_one(row, self._send_timeout_s)
            self._last_seq = seq
            error = None
            producer = self._producer
            # The ceiling is a soft bound (see __init__): a sender that found room above, a moment ago,
            # skips a second len(); one that waited checks it.
            if (self._dispatched_upto == seq - 1 and not self._redeliver and self._fatal is None
                    and not self._held and (room or len(producer) < self._hand_over_ceiling)):
                outcome: bool | str = True
                message_id, topic, value, key, headers, partition = row
                limit = self._limits.get(topic)
                if partition is None and not headers and (limit is None or (
                        len(value) if value else 0) + (len(key) if key else 0) + 4096 <= limit):
                    try:
                        producer.produce(topic, value, key, -1, self._take_slot(seq, self._generation, topic),
                                         None, 0, [(ID_HEADER, message_id.encode())])
                    except (BufferError, KafkaException):
                        outcome = self._produce(row, seq)
                else:
                    outcome = self._produce(row, seq)
                if outcome is not False:
                    if outcome is not True:
                        error = outcome
                    self._dispatched_upto = seq
            self._sent_one += 1  # under the send lock; publish_sent() counts it
        finally:
            lock.release()
        return seq, error

    def publish_sent(self) -> None:
        """Add what accept_one() accepted since the last call to the "sent" and "commits" counters and to
        the accepted-messages metric (each poll round, and before stats() are read)."""
        lock = self._send_lock
        if not lock.acquire(False):
            _acquire_without_queueing(lock)
        try:
            n = self._sent_one - self._sent_one_published
            if n:
                self._sent_one_published += n
                self.counters.add_unlocked("sent", n)  # "sent" is written under the send lock only
                self.counters.add_unlocked("commits", n)  # one record a message: its own "commit"
        finally:
            lock.release()
        if n:
            telemetry.accepted.add(n)

    def accept_now(self, rows: Sequence[NewMessage], errors: dict[int, str]) -> list[int] | None:
        """accept(), for a caller that must never wait (an event loop): None, having stored nothing, where
        accept() would wait — for librdkafka to hold fewer than max_in_flight, for room in the spool, or
        for the send lock another thread holds (the writer's commit, the poller handing over a backlog) —
        and where older rows wait to be handed over (new ones would only join that backlog). The caller
        then takes the path that may wait, off its thread.

        The spool's own lock may still be taken for as long as a round of delivery reports takes to
        record (a dict pop each): that is the poller's CPU, never a wait for the brokers.
        """
        if (len(self._producer) >= self._max_in_flight or self._dispatched_upto != self._last_seq
                or self._redeliver or self._fatal is not None):
            return None
        if not self._send_lock.acquire(blocking=False):
            return None
        try:
            return self._append_and_hand_over(rows, errors, 0.0)  # (the lock is re-entrant)
        except OutboxFull:
            return None  # nothing was stored: the spool is at its bound
        finally:
            self._send_lock.release()

    def _append_and_hand_over(self, rows: Sequence[NewMessage], errors: dict[int, str], timeout: float
                              ) -> list[int]:
        """accept() once it may: append (waiting up to `timeout` for room in the spool) and hand over."""
        with self._send_lock:
            seqs = self._spool.append(rows, timeout=timeout)
            self._last_seq = seqs[-1]
            # Hand over now only when no older row waits (order first) and librdkafka has room;
            # otherwise the poller hands them over from the spool, after the older ones.
            if (self._dispatched_upto == seqs[0] - 1 and not self._redeliver and self._fatal is None
                    and not self._holds and len(self._producer) < self._hand_over_ceiling):
                # The common case inline (no per-message method call: this loop is most of send's cost);
                # anything unusual, and every exception, takes the general path of _produce().
                produce, take = self._producer.produce, self._reports.take
                generation, limits, upto = self._generation, self._limits, self._dispatched_upto
                try:
                    for row, seq in zip(rows, seqs, strict=True):
                        message_id, topic, value, key, headers, partition = row
                        limit = limits.get(topic)
                        if partition is None and not headers and (limit is None or (
                                len(value) if value else 0) + (len(key) if key else 0) + 4096 <= limit):
                            try:
                                # Positional (see _produce): a keyword argument costs ~1 µs per call.
                                produce(topic, value, key, -1, take(seq, generation, topic), None, 0,
                                        [(ID_HEADER, message_id.encode())])
                                upto = seq
                                continue
                            except (BufferError, KafkaException):
                                pass  # _produce() below says what it means
                        outcome = self._produce(row, seq)
                        if outcome is False:
                            break  # librdkafka's queue is full: the poller goes on from here
                        if outcome is not True:
                            errors[seq] = outcome
                        upto = seq
                finally:
                    self._dispatched_upto = upto
            # Once per send() / send_many() call, so unlocked: only accept() writes "sent", always under
            # _send_lock. timeit, 1M calls: 85 ns against 340 ns for the locked add() (a plain dict
            # increment, as before: 60 ns), on a send() of ~20 us. "commits" likewise: one accept()
            # is one outbox transaction, so sent / commits is how many messages a commit carried.
            self.counters.add_unlocked("sent", len(rows))
            self.counters.add_unlocked("commits")
        telemetry.accepted.add(len(rows))
        return seqs

    def _wait_for_room(self) -> None:
        """Backpressure: while the brokers confirm deliveries, wait until librdkafka holds fewer than
        max_in_flight messages. Without it a fast application runs hundreds of thousands of messages
        ahead of the brokers, and every one of them costs memory in librdkafka. While nothing is
        confirmed (brokers away) it does not wait: the spool keeps accepting up to its bound."""
        with self._settled:
            while (len(self._producer) >= self._max_in_flight and not self._stop.is_set()
                   and self._fatal is None and time.monotonic() - self._last_progress < _STALL_S):
                self._settled.wait(0.05)

    def _produce(self, row: NewMessage | OutboxRow, seq: int) -> bool | str:
        """True when librdkafka took it, False when its queue is full, a reason when refused for good."""
        topic, value, key = row.topic, row.value, row.key
        if self._holds and self._holds.takes(topic, seq):
            return True  # its topic waits for a grant: it goes after the probe gets through, in order
        limit = self._limits.get(topic)
        if limit is not None and len(value or b"") + len(key or b"") + 4096 > limit:
            oversized = self._guard.too_large(topic, value, key, row.headers)
            if oversized is not None:
                self._fail(seq, oversized)
                return oversized
        headers: list[tuple[str, str | bytes | None]] = [(ID_HEADER, row.message_id.encode()), *row.headers]
        callback = self._reports.take(seq, self._generation, topic)
        try:
            # produce(topic, value, key, partition, callback, on_delivery, timestamp, headers), all
            # positional: confluent-kafka parses keyword arguments at ~1 µs each, as much as the rest
            # of the call (-1: librdkafka's partitioner picks; 0: the current time).
            self._producer.produce(topic, value, key, -1 if row.partition is None else row.partition, callback,
                                   None, 0, headers)
            return True
        except BufferError:
            return False
        except KafkaException as exc:
            disposition = classify(exc)
            reason = describe(exc)
            if disposition is Disposition.PERMANENT:
                self._fail(seq, reason)
                return reason
            if disposition is Disposition.FATAL:
                self._fatal = exc.args[0]
                return False
            if disposition is Disposition.AUTHORIZATION:
                # librdkafka knows the topic is denied (its metadata said so) and refuses at once.
                self._hold(seq, topic)
                return True
            log.warning("produce of seq %d refused for now (%s); it will be retried", seq, reason)
            self._redeliver.append(seq)
            return True

    def _dispatch_backlog(self) -> None:
        """Poller: hand over spooled rows librdkafka has not got yet, in seq order."""
        if not self._redeliver and self._dispatched_upto >= self._last_seq:
            # Nothing waits (read without the lock: a send in progress is dispatching its own rows, and
            # anything it leaves behind is seen next round). Taking the lock here made every poll round
            # wait for the send in progress, and with it the delivery reports.
            return
        with self._send_lock:
            # Only the seqs queued before this round: a retriable refusal re-queues at the back.
            for _ in range(len(self._redeliver)):
                seq = self._redeliver[0]
                r = self._spool.get(seq)
                if r is not None and r.state == "pending" and self._produce(r, seq) is False:
                    return
                self._redeliver.popleft()
            while self._dispatched_upto < self._last_seq:
                if len(self._producer) >= self._max_in_flight:
                    return  # the rest waits in the spool: librdkafka's copies cost memory
                rows = self._spool.pending(after_seq=self._dispatched_upto, limit=_DISPATCH_PAGE)
                if not rows:
                    self._dispatched_upto = self._last_seq
                    return
                for r in rows:
                    if self._produce(r, r.seq) is False:
                        return
                    self._dispatched_upto = r.seq

    # ---- delivery reports and the poller thread -------------------------------------------

    def _on_delivery(self, seq: int, generation: int, topic: str, err: KafkaError | None, _msg: Any) -> None:
        if err is None:
            # A success is real whatever producer instance reported it.
            self._delivered.append(seq)
            return
        if generation != self._generation:
            return  # purged from a replaced producer: the whole spool is being re-sent anyway
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            # Is the record itself too large, or a batch neighbour of one? Asking the cluster is
            # admin I/O: not inside a callback of poll(), the guard answers after poll() returns.
            self._size_refused.append((seq, topic, describe(err)))
            return
        disposition = classify(err)
        if disposition is Disposition.PERMANENT:
            self._fail(seq, describe(err))
        elif disposition is Disposition.FATAL:
            self._fatal = err
        elif disposition is Disposition.AUTHORIZATION:
            self._denied.append((seq, topic))  # held after poll() returns: it writes to the spool and logs
        else:
            # Unknown outcome (e.g. _MSG_TIMED_OUT): send again; the rk-id makes a duplicate recognisable.
            self._retry(seq, describe(err))

    def _on_delivery_traced(self, seq: int, generation: int, topic: str, err: KafkaError | None, msg: Any) -> None:
        """_on_delivery() and the message's send span. A success ends it here; a permanent or retriable
        failure is recorded by _fail() / _retry(), which also see refusals that never reach a report.

        The message is found by its seq in the spool (a report carries no headers), which still holds it:
        the spool learns of the delivery after poll() returns. One read per report, with tracing only."""
        self._on_delivery(seq, generation, topic, err, msg)
        assert self._spans is not None
        if err is not None and generation == self._generation and classify(err) not in (
                Disposition.FATAL, Disposition.AUTHORIZATION):
            return  # settled by _fail() or _retry()
        row = self._spool.get(seq)
        if row is None:
            return
        if err is None:
            self._spans.delivered(row.message_id, row.topic, row.headers, msg.partition(), msg.offset())
        else:
            # Purged from a replaced producer, or waiting for a grant: sent again later, same span.
            self._spans.retried(row.message_id, describe(err))

    def _settle_size_refusals(self) -> None:
        refused, self._size_refused = self._size_refused, []
        alone = self._guard.oversized([(topic, self._spool.get(seq)) for seq, topic, _ in refused])
        for (seq, _topic, reason), too_large in zip(refused, alone, strict=True):
            if too_large:
                self._fail(seq, reason)
            else:
                self._retry(seq, reason)  # it fits alone: it shared a batch with an oversized record

    def _hold(self, seq: int, topic: str) -> None:
        """Keep `seq` pending while the principal may not write `topic`; say so once per hold."""
        self._spool.record_attempt([seq], "TOPIC_AUTHORIZATION_FAILED: waiting for Write on the topic")
        if self._holds.refused(topic, seq):
            log.error("%s. Messages to it stay pending in the outbox and go out once it is granted "
                      "(checked every %.0f-%.0f s); other topics are not held up",
                      TopicAuthorizationFailed(topic, "Write"), FIRST_WAIT_S, MAX_WAIT_S)

    def _settle_holds(self) -> None:
        """Poller: hold what was refused for want of an ACL, send due probes, release holds whose probe
        went through (delivered, or settled some other way: then the rest is tried on its own merits)."""
        if not self._denied and not self._holds:
            return
        with self._send_lock:
            denied, self._denied = self._denied, []
            for seq, topic in denied:
                self._hold(seq, topic)
            for topic, probe in self._holds.probing().items():
                row = self._spool.get(probe)
                if row is None or row.state != "pending":  # delivered (or failed for another reason)
                    released = self._holds.release(topic)
                    log.warning("topic %r is writable now; sending the %d messages held for it",
                                topic, len(released))
                    self._redeliver.extend(released)
            self._redeliver.extend(self._holds.due_probes())

    def _retry(self, seq: int, reason: str) -> None:
        self.counters.add("retried")
        telemetry.retries.add(1)
        if self._spans is not None and (row := self._spool.get(seq)) is not None:
            self._spans.retried(row.message_id, reason)
        self._spool.record_attempt([seq], reason)
        self._redeliver.append(seq)

    def _fail(self, seq: int, reason: str) -> None:
        self._spool.mark_failed(seq, reason)
        if self._listener is not None:
            self._failed_now.append(seq)  # after the spool says so: a listener's reader sees it failed
        self.counters.add("failed")
        telemetry.sent_messages.add(1, {**telemetry.SEND, "error.type": telemetry.error_type(reason)})
        log.error("message seq %d refused by Kafka for good (%s); kept in the outbox as failed", seq, reason)
        if self._on_failed is not None or self._spans is not None:
            row = self._spool.get(seq)  # by its seq: never a scan of every failed row
            if row is not None and row.state == "failed":
                if self._spans is not None:
                    self._spans.failed(row.message_id, row.topic, row.headers, reason)
                if self._on_failed is not None:
                    self._on_failed(row)

    def set_listener(self, listener: DeliveryListener | None) -> None:
        """Have `listener(delivered, failed)` told, once per poll round that settled anything, which seqs
        were settled in it — after the spool records it, on the poller thread (keep it short: hand over).

        One listener per dispatcher (the asyncio front end resolves its waiters with it); None removes it.
        """
        self._listener = listener

    def _apply_reports(self) -> None:
        if self._sent_one != self._sent_one_published:
            self.publish_sent()  # first: what is counted delivered below was counted sent
        done: list[int] = []
        delivered = self._delivered
        if delivered:
            done = delivered[:]
            del delivered[:len(done)]  # (a report appended meanwhile stays for the next round)
            self._last_progress = time.monotonic()
            self._rebuild_wait_s = 0.0  # a producer id was granted (see _recreate)
            self._login_refused = False
            self._spool.mark_delivered(done)
            # Once per poll round (the callbacks only append seqs), so the lock costs nothing per report:
            # timeit of the delivery-report path, 1M reports in rounds of 1,000: 80 ns a report with a
            # dict increment, 77 ns with this add().
            self.counters.add("delivered", len(done))
            telemetry.sent_messages.add(len(done), telemetry.SEND)
            with self._settled:
                self._settled.notify_all()
        if self._size_refused:
            self._settle_size_refusals()
        listener = self._listener
        if listener is not None and (done or self._failed_now):
            failed, popleft = [], self._failed_now.popleft
            for _ in range(len(self._failed_now)):
                failed.append(popleft())
            try:
                listener(done, failed)
            except Exception:  # the poller must go on: the listener's waiters can still ask state()
                log.exception("delivery listener failed")

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if self._fatal is not None and time.monotonic() < self._rebuild_at:
                    self._stop.wait(0.05)  # see _recreate: a refused producer id waits for its grant
                    continue
                self._poll()
                self._apply_reports()
                if not len(self._producer):
                    self._last_progress = time.monotonic()  # nothing in flight is not a stall
                if self._fatal is not None:
                    self._recreate()
                    # Before the spool goes to the new producer below: its first produce() at once would
                    # wait 0.5 s for a producer id (producer_id.py). Senders leave their rows to this
                    # thread until then (_recreate() left the spool's rows all behind _dispatched_upto).
                    prime_producer_id(self._producer)
                self._settle_holds()
                self._dispatch_backlog()
                self._guard.retry_deferred()
                with self._settled:
                    self._settled.notify_all()
            except Exception:  # the poller must outlive any one bad round, or nothing gets confirmed
                log.exception("producer poll round failed; continuing")
                time.sleep(0.5)
        # Final reports: everything librdkafka has confirmed by now is removed from the spool.
        self._producer.poll(0)
        self._apply_reports()

    def _poll(self) -> None:
        try:
            self._producer.poll(0.05)
        except KafkaException as exc:
            # A client in its fatal state raises its fatal error from poll() (its error_cb saw it too).
            if classify(exc) is not Disposition.FATAL:
                raise
            if self._fatal is None:
                self._fatal = exc.args[0]

    def _recreate(self) -> None:
        """Rebuild the librdkafka producer after a fatal error and re-send the spool in order (L5)."""
        with self._send_lock:
            reason = self._fatal
            old = self._producer
            self._generation += 1
            try:
                old.purge(in_queue=True, in_flight=True)
                old.poll(0)  # successes among the purged reports still count
            except KafkaException:
                pass
            self._apply_reports()
            self._producer = self._new_producer()
            self._fatal = None
            self._redeliver.clear()
            self._dispatched_upto = 0
            self._last_seq = max(self._last_seq, self._max_pending_seq())
            self.counters.add("recreated")
            telemetry.rebuilds.add(1)
            if reason is not None and not_authorized(reason):
                # The idempotent producer could not get a producer id: the principal needs IdempotentWrite
                # on the cluster, or (brokers >= 3.0, KIP-679) Write on any topic. The new producer is
                # refused again until an operator grants it, so the next rebuild waits, longer each time.
                if not self._rebuild_wait_s:
                    log.error("%s (or, with brokers 3.0 and later, Write on the topics it sends to); messages "
                              "stay pending in the outbox until it is granted (%s)",
                              ClusterAuthorizationFailed("IdempotentWrite"), describe(reason))
                self._rebuild_wait_s = min(MAX_WAIT_S, max(FIRST_WAIT_S, self._rebuild_wait_s * 2))
                self._rebuild_at = time.monotonic() + self._rebuild_wait_s
                return
            log.warning("idempotent producer hit a fatal error (%s); recreated it and re-sending the outbox",
                        describe(reason) if reason is not None else "unknown")

    def _max_pending_seq(self) -> int:
        last = 0
        after = 0
        while True:
            rows = self._spool.pending(after_seq=after, limit=_DISPATCH_PAGE)
            if not rows:
                return last
            last = rows[-1].seq
            after = last

    def _new_producer(self) -> Producer:
        conf = dict(self._config)
        conf["error_cb"] = self._on_error
        conf.setdefault("logger", _rdkafka_log)
        if self._rdkafka_stats is not None:
            conf["stats_cb"] = self._rdkafka_stats
        return Producer(conf)

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self._fatal = err
        elif err.code() == KafkaError._AUTHENTICATION:
            if not self._login_refused:
                self._login_refused = True
                log.error("%s; messages stay pending in the outbox until a login succeeds",
                          AuthenticationFailed(self._config.get("sasl.username"),
                                               self._config.get("sasl.mechanism"), str(err.str())))
        elif err.code() == KafkaError._ALL_BROKERS_DOWN:
            log.warning("all brokers are down; messages stay in the outbox until they are back")
        else:
            log.debug("producer: %s", describe(err))
