"""Fault recipes on a LocalKafkaCluster that the tests and the loss lab share.

Each recipe is bounded in time, signals only the cluster's own nodes (or the child process it was
given), and leaves the cluster healthy when it returns (also when the code inside it raised). Each
fault waits, through `reliable_kafka.testing.gates`, for the observable condition that makes it bite.
"""

from __future__ import annotations

import contextlib
import logging
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from reliable_kafka.testing.cluster import LocalKafkaCluster, PartitionState
from reliable_kafka.testing.gates import FaultNotArmed, fire_when

log = logging.getLogger(__name__)

T = TypeVar("T")

_KAFKA_REPLICA_FETCH_WAIT_MS = 500  # the broker's default replica.fetch.wait.max.ms


@dataclass
class IsolatedLeader:
    leader: int
    followers: list[int]
    new_leader: int | None = None


def settled_state(cluster: LocalKafkaCluster, topic: str, partition: int = 0, timeout: float = 60.0) -> PartitionState:
    """The partition's state once two reads a second apart agree on a leader and a full ISR.

    A broker that restarted a moment ago can still answer metadata requests with what it knew before
    (no leader, or the old one); isolating the node such a read names would isolate the wrong one,
    and the recipe would then lose nothing.
    """
    deadline = time.monotonic() + timeout
    previous: PartitionState | None = None
    while True:
        state = cluster.partition_state(topic, partition)
        settled = state is not None and state.leader >= 0 and sorted(state.isr) == sorted(state.replicas)
        if settled and state == previous:
            assert state is not None
            return state
        previous = state if settled else None
        if time.monotonic() > deadline:
            raise RuntimeError(f"{topic}[{partition}] has no settled leader with a full ISR after {timeout:.0f}s "
                               f"(last seen: {state})")
        time.sleep(1.0)


def log_bytes(cluster: LocalKafkaCluster, node_id: int, topic: str, partition: int = 0) -> int:
    """Bytes of the partition's log segments on one node's disk (what it has appended, paused or not).

    Segments are not preallocated, so the size grows with every batch the node appends.
    """
    directory = cluster.nodes[node_id].directory / "data" / f"{topic}-{partition}"
    return sum(f.stat().st_size for f in directory.glob("*.log"))


def leader_ahead(cluster: LocalKafkaCluster, topic: str, iso: IsolatedLeader, partition: int = 0) -> bool:
    """The leader's log holds records that none of its (paused) followers has appended."""
    lead = log_bytes(cluster, iso.leader, topic, partition)
    return all(lead > log_bytes(cluster, f, topic, partition) for f in iso.followers)


def settled_leader(cluster: LocalKafkaCluster, topic: str, partition: int = 0) -> IsolatedLeader:
    """The partition's settled leader and its followers (see `settled_state`)."""
    state = settled_state(cluster, topic, partition)
    return IsolatedLeader(leader=state.leader, followers=[r for r in state.replicas if r != state.leader])


@contextlib.contextmanager
def paused(cluster: LocalKafkaCluster, nodes: Sequence[int]) -> Iterator[None]:
    """The nodes paused (SIGSTOP) inside the block and resumed on the way out, whatever happened inside."""
    for n in nodes:
        cluster.pause(n)
    try:
        yield
    finally:
        for n in nodes:
            cluster.resume(n)


@contextlib.contextmanager
def followers_paused(cluster: LocalKafkaCluster, topic: str, partition: int = 0) -> Iterator[IsolatedLeader]:
    """Both followers of the partition paused (SIGSTOP): what is produced inside reaches the leader alone.

    With two of three controllers paused, the controller quorum cannot shrink the ISR either, so the
    followers stay eligible for election. They are resumed on exit.
    """
    iso = settled_leader(cluster, topic, partition)
    with paused(cluster, iso.followers):
        # A follower's last fetch, sent before it was paused, stays parked at the leader for up to
        # replica.fetch.wait.max.ms. Records produced meanwhile complete it: the response lands in the
        # paused follower's socket, it appends them when resumed, becomes leader with them, and nothing
        # is lost. Measured: produced at once, 2 of 6 attempts lost nothing; after this wait 9 of 9 lost.
        # It is waited out rather than observed because nothing outside can see it: the follower is
        # stopped, its log on disk does not change, and the leader's high watermark only moves on the
        # follower's next fetch, which a paused follower never sends. Only the verdict after the
        # election tells; a run the recipe did not bite is re-armed with `until_it_bites`.
        # The longest a fetch can stay parked, and a second for the leader to send its response (with
        # Kafka's 500 ms, the 1.5 s measured above). It reads the nodes' own setting: the harness runs them
        # with 2 s, and a wait of 3 x 500 ms let fetches parked 1.5-2 s before the pause take the records.
        fetch_wait_s = int(cluster.broker_setting("replica.fetch.wait.max.ms", _KAFKA_REPLICA_FETCH_WAIT_MS)) / 1000
        time.sleep(fetch_wait_s + 1.0)
        yield iso


@contextlib.contextmanager
def isolated_leader(cluster: LocalKafkaCluster, topic: str, partition: int = 0) -> Iterator[IsolatedLeader]:
    """The deterministic acks=1 loss recipe (seed 000): a leader that acknowledges alone, then dies.

    On entry both followers of the partition are paused (see `followers_paused`), so only the leader
    gets what is produced inside the block. On exit, once the leader's log holds records its followers'
    logs do not (the fault bites only then), the leader is SIGKILLed, the followers resume and one of
    them (which never got the records) is elected; the old leader restarts and truncates to the new
    leader's log. Records that only the old leader had are gone: exactly what acks=1 acknowledged and
    acks=all never did.
    """
    isolated: list[IsolatedLeader] = []
    try:
        with followers_paused(cluster, topic, partition) as iso:
            isolated.append(iso)
            failed = True
            try:
                yield iso
                failed = False
            finally:
                if failed:  # the block raised: no gate, just leave the cluster healthy
                    cluster.kill(iso.leader)
            fire_when(lambda: leader_ahead(cluster, topic, iso, partition), lambda: cluster.kill(iso.leader),
                      what=f"isolated leader {iso.leader} of {topic}[{partition}]: kill", timeout_s=30)
    finally:
        for iso in isolated:
            if cluster.nodes[iso.leader].alive():  # the gate never held: heal before FaultNotArmed surfaces
                cluster.kill(iso.leader)
            iso.new_leader = cluster.wait_for_leader(topic, partition, not_on=iso.leader, timeout=60)
            log.info("%s[%d]: leader %d killed, %d elected", topic, partition, iso.leader, iso.new_leader)
            cluster.start_node(iso.leader)
            cluster.wait_healthy()


def until_it_bites(inject: Callable[[], T], bit: Callable[[T], bool], *, what: str, attempts: int = 3) -> T:
    """Inject a fault whose bite only its verdict shows, again (fresh each time) until it bit; the last result.

    For recipes with no observable condition before the fault (see `followers_paused`): each run is
    judged by `bit` and a run that did not bite is re-armed through `fire_when`, bounded and logged.
    The caller still asserts the verdict: after `attempts` runs the last one is returned as it is.
    """
    results = [inject()]

    def again() -> None:
        log.warning("%s: did not bite (%s); injecting it again", what, results[-1])
        results.append(inject())

    with contextlib.suppress(FaultNotArmed):
        fire_when(lambda: bit(results[-1]), lambda: None, what=what, rearm=again, attempts=attempts, timeout_s=0)
    return results[-1]


def hard_bounce_leader(cluster: LocalKafkaCluster, topic: str, partition: int = 0, *,
                       when: Callable[[], bool] | None = None, rearm: Callable[[], None] | None = None,
                       attempts: int = 3, timeout_s: float = 30.0,
                       followers_behind: Callable[[], int] | None = None, behind_by: int = 2_000,
                       leader_ahead_first: bool = True) -> tuple[int, int]:
    """SIGKILL the partition's leader, wait for a new one, restart the old; returns (old, new).

    With `when`, the kill waits (bounded, re-armed by `rearm`, see `fire_when`) until that condition
    holds, e.g. "the stream is past its first records and not finished", so it lands mid-work.

    With `followers_behind`, the followers stall first: once `when` holds they are paused (SIGSTOP, as
    a long GC pause or a stuck disk leaves them, and in the ISR still), and the kill waits until the
    leader's log holds records theirs do not (unless not `leader_ahead_first`) and `followers_behind()`,
    a count of the stream's progress (records acknowledged, or handed to the client), grew by
    `behind_by` since the pause; they resume after the kill and one of them is elected. The first is
    what an acks=1 client loses; an acks=all client may never put a record on the leader alone: its
    in-flight requests wait for the stalled followers, and once its in-flight window is full it sends
    nothing more (seen: the leader's log stayed level with theirs for the whole 20 s bound). Without
    the stall, followers fetch within milliseconds of each append, so what a kill finds on the leader
    alone is chance: an acks=1 control lost 0, 100 or 2,700 of 60,000 from one lab run to the next.
    (Replication throttling cannot hold in-sync followers back: the broker throttles only replicas out
    of the ISR, to avoid ISR thrashing.)
    """
    def kill() -> int:
        # Looked up at the moment of the kill: a preferred-leader election may have moved it since.
        leader = cluster.leader_of(topic, partition)
        if leader is None:
            raise RuntimeError(f"{topic}[{partition}] has no leader")
        cluster.kill(leader)
        return leader

    what = f"hard bounce of the leader of {topic}[{partition}]"
    if followers_behind is None:
        old = kill() if when is None else fire_when(when, kill, what=what, rearm=rearm, attempts=attempts,
                                                    timeout_s=timeout_s)
    else:
        old = _stall_then_kill(cluster, topic, partition, when or (lambda: True), rearm, followers_behind,
                               behind_by, leader_ahead_first, what=what, attempts=attempts, timeout_s=timeout_s)
    new = cluster.wait_for_leader(topic, partition, not_on=old, timeout=60)
    cluster.start_node(old)
    return old, new


def _stall_then_kill(cluster: LocalKafkaCluster, topic: str, partition: int, when: Callable[[], bool],
                     rearm: Callable[[], None] | None, progress: Callable[[], int], behind_by: int,
                     leader_ahead_first: bool, *, what: str, attempts: int, timeout_s: float) -> int:
    """`hard_bounce_leader` with stalled followers; the killed leader. Each attempt reads the settled
    leader, waits for `when`, pauses the followers and waits for the stream to get `behind_by` ahead of
    them; if it does not, the followers resume and the attempt is re-armed (bounded, logged)."""
    for attempt in range(1, attempts + 1):
        # Read while the cluster is settled, before the stream's window opens: it takes a second or two.
        iso = settled_leader(cluster, topic, partition)

        def stall_and_kill(iso: IsolatedLeader = iso) -> bool:
            # On the way out the leader is dead, or lives on (not armed): either way the followers go on.
            with paused(cluster, iso.followers):
                before = progress()
                try:
                    fire_when(lambda: progress() - before >= behind_by
                              and (not leader_ahead_first or leader_ahead(cluster, topic, iso, partition)),
                              lambda: cluster.kill(iso.leader),
                              what=f"{what}: leader {iso.leader} ahead of its stalled followers",
                              timeout_s=timeout_s)
                    return True
                except FaultNotArmed:
                    return False

        if fire_when(when, stall_and_kill, what=what, rearm=rearm, attempts=attempts, timeout_s=timeout_s):
            return iso.leader
        if attempt < attempts:
            log.warning("%s: the stream did not get %d ahead of the stalled followers within %.0fs; followers "
                        "resumed, re-arming (attempt %d of %d)", what, behind_by, timeout_s, attempt + 1, attempts)
            if rearm is not None:
                rearm()
    raise FaultNotArmed(f"{what}: the stream never got {behind_by} ahead of the stalled followers "
                        f"({attempts} attempt(s) of {timeout_s:.0f}s)")


class SendStream:
    """Sends values in batches from a thread, paced, so that a fault gated on its progress finds it mid-stream.

    `send(batch)` hands one batch to the client under test; `running` is true until the last batch
    was handed over. Pacing slows the input, not the check: the gate decides when the fault fires.
    """

    def __init__(self, send: Callable[[Sequence[bytes]], Any], values: Sequence[bytes], *, rate: float,
                 batch: int = 100, name: str = "send-stream") -> None:
        self._send, self._values, self._rate, self._batch = send, values, rate, batch
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self.sent = 0
        self.error: BaseException | None = None

    def start(self) -> SendStream:
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float = 120.0) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the send stream did not finish in {timeout_s:.0f}s ({self.sent} sent)")
        if self.error is not None:
            raise RuntimeError(f"the send stream failed: {self.error!r}") from self.error

    def _run(self) -> None:
        started = time.monotonic()
        try:
            for i in range(0, len(self._values), self._batch):
                self._send(self._values[i:i + self._batch])
                self.sent = min(i + self._batch, len(self._values))
                ahead = self.sent / self._rate - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)
        except BaseException as exc:  # surfaced by join(): a dead stream must fail the run, not hang it
            self.error = exc
            log.exception("send stream failed")


def bounce_leader_mid_stream(
    cluster: LocalKafkaCluster,
    topic: str,
    send: Callable[[Sequence[bytes]], Any],
    chunk: Callable[[int], list[bytes]],
    *,
    rate: float,
    confirmed: Callable[[], int],
    at_least: int,
    unconfirmed: Callable[[], bool] = lambda: True,
    stall_followers: bool = False,
    partition: int = 0,
    attempts: int = 3,
    timeout_s: float = 20.0,
) -> list[bytes]:
    """Stream `chunk(0)` through `send`, paced at `rate`/s, and hard-bounce the leader mid-stream.

    The kill fires once `confirmed()` (e.g. the client's delivered count) grew by `at_least` since the
    stream began, while the stream is still running and `unconfirmed()` (records still in flight)
    holds. Should the stream end before that, `chunk(1)`, `chunk(2)`... are streamed (a logged,
    bounded re-arm). Returns every value handed to `send`, once each stream has ended.
    With `stall_followers`, the followers are paused at that point and the kill waits until `at_least`
    more values were handed to `send` (see `hard_bounce_leader`'s `followers_behind`): for an acks=all
    client, whose records then wait unconfirmed, whether or not they reached the leader.
    """
    streams: list[SendStream] = []
    values: list[bytes] = []

    def stream() -> None:
        more = chunk(len(streams))
        values.extend(more)
        streams.append(SendStream(send, more, rate=rate, name=f"stream-{topic}-{len(streams)}").start())

    def rearm() -> None:
        if not streams[-1].running:  # it ended before the kill: the next one is killed instead
            stream()

    before = confirmed()
    stream()
    try:
        hard_bounce_leader(cluster, topic, partition, rearm=rearm, attempts=attempts, timeout_s=timeout_s,
                           when=lambda: streams[-1].running and confirmed() - before >= at_least and unconfirmed(),
                           followers_behind=(lambda: sum(s.sent for s in streams)) if stall_followers else None,
                           behind_by=at_least, leader_ahead_first=False)
    finally:
        for s in streams:
            s.join()
    return values


@dataclass
class ProducerCrashes:
    accepted: list[int]  # every index a run's ledger recorded as accepted
    kills: int
    exit_code: int | None  # of the last run, which was let finish (None if it never finished)


def sigkill_producer_mid_stream(
    start: Callable[[int], subprocess.Popen[Any]],
    ledger: Path,
    status: Path,
    *,
    kills: int,
    between: tuple[int, int],
    rng: random.Random,
    what: str,
    timeout_s: float = 60.0,
    attempts: int = 3,
    finish_timeout_s: float = 180.0,
) -> ProducerCrashes:
    """Run a producer child, SIGKILL it `kills` times mid-stream, then let a last run finish.

    `start(first_index)` launches the child (reliable_kafka.lab.programs.producer_proc) from that
    index on, with this `ledger` and `status`. Each kill is gated on progress, not time: this run has
    had a random `between` more messages accepted (its ledger) and some accepted ones are not yet
    delivered (its status), so every kill catches messages in flight. A child that ended before its
    kill is restarted from its ledger (a logged, bounded re-arm); only the child is ever signalled.
    """
    child = _ProducerChild(start, ledger, status, what)
    done_kills = 0
    try:
        while done_kills < kills:
            target = len(child.accepted()) + rng.randint(*between)
            fire_when(partial(child.ready_to_kill, target), child.kill,
                      what=f"{what}: SIGKILL {done_kills + 1} of {kills}", rearm=child.restart_if_ended,
                      attempts=attempts, timeout_s=timeout_s, poll_s=0.01)
            done_kills += 1
            child.launch()
        code = child.finish(finish_timeout_s)
    finally:
        child.kill()
    return ProducerCrashes(accepted=child.accepted(), kills=done_kills, exit_code=code)


class _ProducerChild:
    """The current run of a producer child and what its ledger and status files say."""

    def __init__(self, start: Callable[[int], subprocess.Popen[Any]], ledger: Path, status: Path, what: str) -> None:
        self._start, self._ledger, self._status, self._what = start, ledger, status, what
        ledger.touch()
        self._proc = self.launch()

    def accepted(self) -> list[int]:
        # Only whole lines: a SIGKILL can land inside the child's ledger write and leave a torn last
        # line ("1209" of "12091"), which is not a record of anything.
        text = self._ledger.read_text()
        return [int(x) for x in text[: text.rfind("\n") + 1].split()]

    def undelivered(self) -> int:
        try:
            return int(self._status.read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def launch(self) -> subprocess.Popen[Any]:
        """Start a run from the first index its ledger does not hold."""
        self._status.unlink(missing_ok=True)  # a fresh run says nothing until its first batch
        self._drop_torn_line()
        done = self.accepted()
        self._proc = self._start(max(done) + 1 if done else 0)
        return self._proc

    def _drop_torn_line(self) -> None:
        """Cut a torn last line left by a kill mid-write, so the next run's lines do not glue onto it.

        Without this "12091" + "12092\n" read as index 1209112092 and the next run started past the end.
        The torn entry's message was accepted or not; the next run re-sends from the last whole line.
        """
        data = self._ledger.read_bytes()
        if data and not data.endswith(b"\n"):
            with open(self._ledger, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def ready_to_kill(self, target: int) -> bool:
        return (self._proc.poll() is None and self._ledger.read_bytes().count(b"\n") >= target
                and self.undelivered() > 0)

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()  # SIGKILL, only our own child
        self._proc.wait()

    def restart_if_ended(self) -> None:
        if self._proc.poll() is not None:
            log.warning("%s: the child ended (exit %s) before its kill; restarting it from its ledger",
                        self._what, self._proc.returncode)
            self.launch()

    def finish(self, timeout_s: float) -> int | None:
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
