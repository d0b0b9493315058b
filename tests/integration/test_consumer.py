"""ReliableConsumer against the real cluster: nothing is skipped through crashes, rebalances,
coordinator loss and poison records; an auto-commit control beside it shows the faults bite."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, ConsumerGroupState, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.consumer import DeadLetterPolicy, ReliableConsumer
from reliable_kafka.consumer.rebalance import leave_before_close
from reliable_kafka.dedup import SQLiteDedupStore
from reliable_kafka.dlq import parse_dead_letter_headers
from reliable_kafka.errors import DedupStoreUnavailable
from reliable_kafka.lab.consumer_crash import BITES, kill_loop
from reliable_kafka.lab.programs.status import GroupOffsets, MemberStatus
from reliable_kafka.producer import ReliableProducer
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.testing import LocalKafkaCluster, consume_all
from reliable_kafka.testing.gates import Feeder, fire_when, wait_for
from tests.fixtures.members import MemberLogs

pytestmark = pytest.mark.cluster
log = logging.getLogger(__name__)

CHILD = [sys.executable, "-m", "reliable_kafka.lab.programs.consumer_proc"]
ROOT = Path(__file__).resolve().parents[2]


def fill(bootstrap: str, topic: str, n: int, prefix: str = "m") -> list[str]:
    values = [f"{prefix}-{i}" for i in range(n)]
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 10})
    for v in values:
        produce_when_room(p, topic, v.encode(), key=v.encode())
    assert p.flush(60) == 0
    return values


def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        got = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=15)
        return {tp.partition: tp.offset for tp in got}
    finally:
        c.close()


def base_conf(kafka: LocalKafkaCluster, group: str | None = None) -> dict[str, object]:
    return {"bootstrap.servers": kafka.bootstrap_servers, "group.id": group or f"g-{uuid.uuid4().hex[:8]}",
            "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}


def _run_until(consumer: ReliableConsumer, handler, condition, timeout: float = 60.0) -> None:
    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        consumer.stop()

    threading.Thread(target=watch, daemon=True).start()
    consumer.run(handler)


def _kill_loop(mode: str, kafka: LocalKafkaCluster, topic: str, values: list[str], ledger: Path, kills: int,
               seed: int, sleep_ms: float, min_handled: tuple[int, int], member_logs: MemberLogs) -> int:
    """Start the member and SIGKILL it `kills` times, each once it is mid-work (see kill_loop); then let
    it finish. Its stdout and stderr go to its member log, appended across restarts."""
    group = f"crash-{mode}-{uuid.uuid4().hex[:6]}"
    status_file = ledger.with_suffix(".status.json")
    cmd = CHILD + ["--mode", mode, "--bootstrap", kafka.bootstrap_servers, "--topic", topic, "--group", group,
                   "--ledger", str(ledger), "--sleep-ms", str(sleep_ms), "--instance-id", "member-1",
                   "--idle", "6", "--status-file", str(status_file)]

    def spawn(final: bool) -> subprocess.Popen[bytes]:
        with member_logs.path(mode).open("ab") as out:
            return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def top_up() -> None:  # only if a kill's condition did not come: the member ran out of input
        values.extend(fill(kafka.bootstrap_servers, topic, 2_000, prefix=f"top-{len(values)}"))

    with GroupOffsets(kafka.bootstrap_servers, group, topic, 3) as offsets:
        done, code = kill_loop(spawn, what=f"the {mode} member", bite=BITES[mode], status_file=status_file,
                               offsets=offsets, kills=kills, rng=random.Random(seed), min_handled=min_handled,
                               top_up=top_up)
    assert code == 0, f"the {mode} member's final run exited {code}"
    return done


@pytest.mark.slow
def test_consumer_sigkilled_ten_times_handles_everything_while_autocommit_skips(kafka, make_topic, tmp_path,
                                                                                 member_logs) -> None:
    # Each kill lands once the member has handled a few hundred to 2,000 records in its life and
    # holds handled records the group has not committed; the control's, once its auto-commit has
    # run ahead of its handler. Ten kills of ours take at most ~25,000 of the 50,000 records.
    topic = make_topic(partitions=3)
    values = fill(kafka.bootstrap_servers, topic, 50_000)
    ours_ledger = tmp_path / "ours.ledger"
    kills = _kill_loop("reliable", kafka, topic, values, ours_ledger, kills=10, seed=3, sleep_ms=0.05,
                       min_handled=(200, 2_000), member_logs=member_logs)
    assert kills == 10
    handled = Counter(line.split("\t")[0] for line in ours_ledger.read_text().splitlines())
    gaps = set(values) - handled.keys()
    duplicates = sum(n - 1 for n in handled.values())
    assert not gaps, f"{len(gaps)} messages never handled, e.g. {sorted(gaps)[:5]}"
    # Redelivery is bounded by what was in flight (fetched, not committed) at each kill.
    assert duplicates <= kills * 20_000

    control_topic = make_topic(partitions=3)
    control_values = fill(kafka.bootstrap_servers, control_topic, 20_000)
    control_ledger = tmp_path / "control.ledger"
    c_kills = _kill_loop("control", kafka, control_topic, control_values, control_ledger, kills=4, seed=4,
                         sleep_ms=1.0, min_handled=(100, 1_500), member_logs=member_logs)
    control_gaps = set(control_values) - {line.split("\t")[0] for line in control_ledger.read_text().splitlines()}
    log.info("consumer SIGKILLs: ours %d kills, %d of %d never handled, %d handled twice; "
             "auto-commit control %d kills, %d of %d never handled",
             kills, len(gaps), len(values), duplicates, c_kills, len(control_gaps), len(control_values))
    assert c_kills == 4
    assert len(control_gaps) > 0, "the auto-commit control skipped nothing: the fault did not bite"


class _Ledger:
    """The values handled so far by the members sharing a ledger, read incrementally (a line each)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._pos = 0
        self._partial = b""
        self._values: set[str] = set()
        self._lock = threading.Lock()  # the feeder's thread reads it too

    def values(self) -> set[str]:
        with self._lock:
            if self._path.exists():
                with self._path.open("rb") as f:
                    f.seek(self._pos)
                    data = f.read()
                self._pos += len(data)
                lines = (self._partial + data).split(b"\n")
                self._partial = lines.pop()  # a line still being written
                self._values.update(line.split(b"\t", 1)[0].decode() for line in lines)
            return set(self._values)

    def count(self) -> int:
        return len(self.values())


class _Member:
    def __init__(self, name: str, proc: subprocess.Popen[bytes], status: Path) -> None:
        self.name, self.proc, self.status = name, proc, status


@pytest.mark.slow
def test_rebalance_storm_of_joins_kills_and_clean_stops_leaves_no_gaps(kafka, make_topic, tmp_path,
                                                                       member_logs) -> None:
    topic = make_topic(partitions=6)
    values = fill(kafka.bootstrap_servers, topic, 30_000)
    group = f"storm-{uuid.uuid4().hex[:6]}"
    ledger = tmp_path / "storm.ledger"
    handled = _Ledger(ledger)
    everyone: list[_Member] = []

    def spawn() -> _Member:
        # The members do not stop on their own (an idle timer would race the session timeout of a
        # killed member on a slow host): the test stops them once the ledger is complete. A member is
        # handed back only once it honours SIGTERM: stopped while still importing, it would die of it.
        name = f"member-{len(everyone)}"
        ready, status = tmp_path / f"{name}.ready", tmp_path / f"{name}.status.json"
        with member_logs.path(name).open("ab") as out:
            child = subprocess.Popen(CHILD + ["--mode", "reliable", "--bootstrap", kafka.bootstrap_servers,
                                              "--topic", topic, "--group", group, "--ledger", str(ledger),
                                              "--sleep-ms", "0.3", "--idle", "600", "--concurrency", "2",
                                              "--ready-file", str(ready), "--status-file", str(status)],
                                     cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        everyone.append(_Member(name, child, status))
        assert wait_for(lambda: ready.exists() or child.poll() is not None, timeout_s=60) and ready.exists(), \
            f"group member {name} did not start (exit {child.poll()})"
        return everyone[-1]

    feed_lock = threading.Lock()

    def top_up() -> None:
        with feed_lock:
            values.extend(fill(kafka.bootstrap_servers, topic, 3_000, prefix=f"top-{len(values)}"))

    members = [spawn() for _ in range(3)]
    rng = random.Random(11)
    try:
        # The input is kept ahead of the members until the last event has fired, so no event finds
        # the group idle with everything committed (where a kill or a leave proves nothing).
        with GroupOffsets(kafka.bootstrap_servers, group, topic, 6) as offsets, \
                Feeder(top_up, lambda: len(values) - handled.count(), low=2_000, max_top_ups=40,
                       name="storm-feeder") as feeder:
                for event in range(5):
                    victim = members[rng.randrange(len(members))]
                    kill = event % 2 == 0
                    wanted = rng.randint(300, 1_500)
                    before = MemberStatus.read(victim.status)
                    base = before.handled if before is not None else 0

                    def mid_work(victim: _Member = victim, base: int = base, wanted: int = wanted) -> bool:
                        # The victim handled `wanted` more records since the last event (the group has
                        # settled from it) and holds handled records the group has not committed.
                        if victim.proc.poll() is not None:
                            raise AssertionError(f"{victim.name} exited ({victim.proc.returncode}) unasked")
                        status = MemberStatus.read(victim.status)
                        return (status is not None and status.handled - base >= wanted
                                and status.uncommitted(offsets.get()) > 0)

                    def strike(victim: _Member = victim, kill: bool = kill) -> None:
                        if kill:
                            victim.proc.kill()  # SIGKILL: no commit, no goodbye
                        else:
                            victim.proc.terminate()  # SIGTERM: graceful stop, commit, leave

                    fire_when(mid_work, strike, attempts=3, timeout_s=60, rearm=top_up,
                              what=f"storm event {event}: {'SIGKILL' if kill else 'SIGTERM'} of {victim.name}")
                    member_logs.reap(victim.name, victim.proc, timeout_s=60)
                    members.remove(victim)
                    members.append(spawn())
        log.info("rebalance storm: 5 events fired, %d records (%d top-ups)", len(values), feeder.top_ups)
        wait_for(lambda: handled.count() >= len(values), timeout_s=200, poll_s=1.0)
        codes = []
        for m in members:  # one at a time: each commits and leaves, the rest take over and commit too
            m.proc.terminate()
            codes.append(member_logs.reap(m.name, m.proc, timeout_s=60))
        assert codes == [0] * len(members)
    finally:
        for m in everyone:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
    gaps = set(values) - handled.values()
    assert not gaps, f"{len(gaps)} messages never handled"
    assert sum(committed(kafka.bootstrap_servers, group, topic, 6).values()) == len(values)


def test_close_during_a_rebalance_gives_the_partitions_back_before_the_client_closes(kafka, make_topic,
                                                                                     caplog) -> None:
    """A rebalance that starts after run() returned leaves a revoke waiting on the consumer's queue until
    something serves it. Served from inside librdkafka's close, it once hung a SIGTERMed member of the
    rebalance storm for good (the close waited on a group it had torn down), and elsewhere its commit failed
    with _DESTROY, retried for 30 s. close() serves it itself, before the client's close, and commits there."""
    topic = make_topic(partitions=2)
    values = fill(kafka.bootstrap_servers, topic, 400)
    group = f"close-{uuid.uuid4().hex[:6]}"
    # Heartbeats every 100 ms: the member hears of the rebalance soon after the group enters it.
    conf = {**base_conf(kafka, group), "heartbeat.interval.ms": 100}
    handled: list[str] = []
    first = ReliableConsumer(conf, [topic])
    _run_until(first, lambda msg: handled.append(msg.value().decode()), lambda: len(handled) == len(values))
    assert sorted(handled) == sorted(values)
    # run() returned and nothing polls `first` any more; librdkafka's own thread keeps its heartbeats going.
    second = Consumer({**base_conf(kafka, group), "auto.offset.reset": "earliest"})
    # What `second` holds, as its callbacks say: no call into it while its poller thread polls (it would
    # wait for the poller to let go of the client, which a poll loop does not do).
    held: set[int] = set()
    second.subscribe([topic], on_assign=lambda _, tps: held.update(tp.partition for tp in tps),
                     on_revoke=lambda _, tps: held.difference_update(tp.partition for tp in tps))
    joining = threading.Event()
    poller = threading.Thread(target=lambda: [second.poll(0.1) for _ in iter(joining.is_set, True)], daemon=True)
    poller.start()
    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    revokes = _RevokeCallers()
    caplog.set_level(logging.INFO, logger="reliable_kafka.consumer.rebalance")  # its "revoked" line
    logging.getLogger("reliable_kafka.consumer.rebalance").addHandler(revokes)
    try:
        def rebalancing() -> bool:
            state = admin.describe_consumer_groups([group])[group].result(timeout=10).state
            return state == ConsumerGroupState.PREPARING_REBALANCING
        assert wait_for(rebalancing, timeout_s=60, poll_s=0.05), "the second member's join started no rebalance"
        # The group waits for `first` to rejoin, which it cannot do before its revoke is served, so the
        # revoke stays on its queue from its next heartbeat on; five heartbeat intervals cover that.
        time.sleep(0.5)
        closing = threading.Thread(target=first.close, daemon=True)
        started = time.monotonic()
        closing.start()
        closing.join(timeout=60)
        took = time.monotonic() - started
        assert not closing.is_alive(), "close() did not return within 60 s"
        # The group settles on `second`; it leaves the same way (a raw client meets the same hazard).
        assert wait_for(lambda: len(held) == 2, timeout_s=60), "the partitions never moved on to the second member"
    finally:
        logging.getLogger("reliable_kafka.consumer.rebalance").removeHandler(revokes)
        joining.set()
        poller.join(timeout=10)
        leave_before_close(second, {}, lambda: bool(held), 30)
        second.close()
    # Where the revoke ran: the Python frame under on_revoke is the code that served the client's queue.
    assert revokes.callers == ["leave_before_close"], \
        f"the revoke was served by {revokes.callers}, not before the client's close"
    assert took < 20, f"close() took {took:.1f}s"
    assert sum(committed(kafka.bootstrap_servers, group, topic, 2).values()) == len(values)


class _RevokeCallers(logging.Handler):
    """Notes, for each "revoked ..." log line of the rebalance handler, the function that called on_revoke
    (through librdkafka: the nearest Python frame below it on the stack)."""

    def __init__(self) -> None:
        super().__init__()
        self.callers: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.getMessage().startswith("revoked"):
            return
        names = [frame.name for frame in traceback.extract_stack()]
        if "on_revoke" in names:
            self.callers.append(names[names.index("on_revoke") - 1])


def test_a_partition_paused_before_a_rebalance_is_fetched_again_when_it_comes_back(kafka, make_topic) -> None:
    """librdkafka keeps a partition paused across a rebalance. A member that paused everything (its
    backlog was full), lost the partitions to a newcomer and got them back must fetch them again: the
    rebalance storm once stalled on such a partition (its records never handled, all members healthy).
    """
    topic = make_topic(partitions=2)
    values = fill(kafka.bootstrap_servers, topic, 200)
    conf = base_conf(kafka)
    first = ReliableConsumer(conf, [topic]).start()  # subscribed: hold_paused() below does not start it
    second = None
    try:
        # hold_paused() is what run() does while the backlog is full: pause everything, serve the group.
        deadline = time.monotonic() + 60
        while len(first.assignment) < 2 and time.monotonic() < deadline:
            first._fetcher.hold_paused(0.2)
        first._fetcher.hold_paused(0.2)  # both partitions now paused by us
        assert len(first.assignment) == 2
        second = ReliableConsumer(conf, [topic])
        deadline = time.monotonic() + 60
        while not second.assignment and time.monotonic() < deadline:
            second.poll(0.2)  # records it gets are never acked: they stay uncommitted
            first._fetcher.hold_paused(0.2)
        assert second.assignment, "the second member never got a partition"
        second.close()
        second = None
        deadline = time.monotonic() + 60
        while len(first.assignment) < 2 and time.monotonic() < deadline:
            first._fetcher.hold_paused(0.2)
        assert len(first.assignment) == 2, "the first member did not get both partitions back"
        handled: set[str] = set()

        def handler(msg) -> None:
            handled.add(msg.value().decode())
            if len(handled) == len(values):
                first.stop()

        first.run(handler, stop_after=45)
        assert handled == set(values), f"{len(set(values) - handled)} records never fetched"
    finally:
        if second is not None:
            second.close()
        first.close()


class _LatePause:
    """Wraps the inner Consumer so the first `misses` pause() calls leave the partitions fetching: what
    a rebalance does when it assigns a partition between our pause and our poll."""

    def __init__(self, inner: Consumer, misses: int) -> None:
        self._inner = inner
        self.misses = misses

    def pause(self, partitions: list[TopicPartition]) -> None:
        if self.misses > 0:
            self.misses -= 1
            return
        self._inner.pause(partitions)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def test_records_fetched_while_the_backlog_is_full_are_held_not_dropped(kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    values = fill(kafka.bootstrap_servers, topic, 300)
    conf = base_conf(kafka)
    handled: list[str] = []
    lock = threading.Lock()

    def handler(msg) -> None:
        time.sleep(0.01)  # slow enough that the backlog (10 records) stays full
        with lock:
            handled.append(msg.value().decode())

    consumer = ReliableConsumer(conf, [topic], concurrency=2, max_batch=10, max_in_flight=10, commit_interval_s=0.1)
    # The rebalance handler owns pausing: the partition then counts as paused but fetches on.
    late = _LatePause(consumer._rebalance.client, misses=1)
    consumer._rebalance.client = late  # type: ignore[assignment]
    consumer._fetcher.room_wait_s = 0.0  # pause as soon as the backlog is full (else it waits for room first)
    _run_until(consumer, handler, lambda: len(set(handled)) >= len(values), timeout=30)
    time.sleep(0.5)
    consumer.close()
    assert late.misses == 0, "the backlog never filled up: the test proved nothing"
    missing = set(values) - set(handled)
    assert not missing, f"{len(missing)} records fetched while paused were dropped, e.g. {sorted(missing)[:3]}"
    assert committed(kafka.bootstrap_servers, conf["group.id"], topic, 1)[0] == len(values)


def test_a_handler_whose_dedup_store_is_down_is_retried_not_dead_lettered(kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    kafka.create_topic(f"{topic}.dlq", 1, 3)
    fill(kafka.bootstrap_servers, topic, 3)  # m-0, m-1, m-2
    attempts: Counter[str] = Counter()
    handled: list[str] = []

    def handler(msg) -> None:
        value = msg.value().decode()
        attempts[value] += 1
        if value == "m-1" and attempts[value] <= 5:  # the handler's own store is down for a while
            raise DedupStoreUnavailable("redis://127.0.0.1:1: connection refused")
        if value == "m-2":
            raise ValueError("poison")  # the control: a real poison record is dead-lettered
        handled.append(value)

    consumer = ReliableConsumer(base_conf(kafka), [topic], retry=RetryPolicy(attempts=2, initial_backoff_s=0.01))
    _run_until(consumer, handler, lambda: consumer.stats().dead_lettered >= 1 and len(handled) >= 2, 60)
    consumer.close()
    assert handled == ["m-0", "m-1"] and attempts["m-1"] == 6
    dead = [m.value() for m in consume_all(kafka.bootstrap_servers, f"{topic}.dlq")]
    assert dead == [b"m-2"], "only the poison record may be dead-lettered"


def test_stop_during_batch_retries_releases_the_dedup_claims(kafka, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=1)
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, durability="memory") as p:
        for i in range(3):
            p.send(topic, f"v{i}".encode(), message_id=f"id-{i}")
        assert p.flush(30) == 0
    calls = threading.Event()

    def failing_batch(msgs) -> None:
        calls.set()
        raise TimeoutError("downstream is slow")

    with SQLiteDedupStore(tmp_path / "dedup.db") as store:
        consumer = ReliableConsumer(base_conf(kafka), [topic], dedup=store,
                                    retry=RetryPolicy(attempts=50, initial_backoff_s=0.2, jitter=False))
        threading.Thread(target=lambda: (calls.wait(60), time.sleep(0.3), consumer.stop()), daemon=True).start()
        consumer.run(failing_batch, batch=True)
        consumer.close()
        assert calls.is_set()
    # The next owner of the partition can claim the records at once, not after the 60 s lease.
    with SQLiteDedupStore(tmp_path / "dedup.db") as other:
        result = other.claim(["id-0", "id-1", "id-2"], 30)
    assert result.claimed == {"id-0", "id-1", "id-2"}, result


def test_commits_never_pass_an_unfinished_record_with_concurrency(kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    values = fill(kafka.bootstrap_servers, topic, 2_000)
    conf = base_conf(kafka)
    blocker = threading.Event()
    handled: list[str] = []
    lock = threading.Lock()

    def handler(msg) -> None:
        if msg.offset() == 100:
            blocker.wait(60)  # offset 100 finishes last
        time.sleep(random.random() / 5000)
        with lock:
            handled.append(msg.value().decode())

    consumer = ReliableConsumer(conf, [topic], concurrency=4, commit_interval_s=0.05)
    seen_commits: list[int] = []

    def watch() -> None:
        # Records keyed to the blocked worker queue behind offset 100; the rest finish. Wait until
        # progress stalls, then look at what the group committed.
        deadline = time.monotonic() + 60
        last = -1
        while time.monotonic() < deadline and (len(handled) != last or len(handled) < 1000):
            last = len(handled)
            time.sleep(1.0)
        seen_commits.append(committed(kafka.bootstrap_servers, conf["group.id"], topic, 1)[0])
        blocker.set()
        while len(handled) < 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        consumer.stop()

    threading.Thread(target=watch, daemon=True).start()
    consumer.run(handler)
    consumer.close()
    assert sorted(handled) == sorted(values)
    assert seen_commits and seen_commits[0] <= 100, f"committed {seen_commits[0]} past unfinished offset 100"
    assert committed(kafka.bootstrap_servers, conf["group.id"], topic, 1)[0] == 2000


def test_poison_record_is_retried_then_dead_lettered_and_its_partition_goes_on(kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    kafka.create_topic(f"{topic}.dlq", 1, 3)
    values = fill(kafka.bootstrap_servers, topic, 50)
    attempts: Counter[str] = Counter()
    handled: list[str] = []

    def handler(msg) -> None:
        v = msg.value().decode()
        attempts[v] += 1
        if v == "m-20":
            raise ValueError("cannot parse m-20")
        handled.append(v)

    conf = base_conf(kafka)
    consumer = ReliableConsumer(conf, [topic], retry=RetryPolicy(attempts=3, initial_backoff_s=0.01,
                                                                  max_backoff_s=0.05))
    _run_until(consumer, handler, lambda: len(handled) == 49)
    consumer.close()
    assert attempts["m-20"] == 3
    assert handled == [v for v in values if v != "m-20"]
    dead = list(consume_all(kafka.bootstrap_servers, f"{topic}.dlq"))
    assert [m.value() for m in dead] == [b"m-20"]
    info = parse_dead_letter_headers(dead[0].headers())
    assert (info.topic, info.partition, info.offset, info.attempts) == (topic, 0, 20, 3)
    assert info.error_type.endswith("ValueError") and "cannot parse m-20" in info.error
    assert committed(kafka.bootstrap_servers, conf["group.id"], topic, 1)[0] == 50


def test_missing_dlq_topic_holds_the_commit_at_the_poison_record(kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    fill(kafka.bootstrap_servers, topic, 30)
    handled: list[str] = []

    def handler(msg) -> None:
        if msg.value() == b"m-10":
            raise ValueError("poison")
        handled.append(msg.value().decode())

    conf = base_conf(kafka)
    consumer = ReliableConsumer(conf, [topic], retry=RetryPolicy(attempts=2, initial_backoff_s=0.01),
                                dead_letter=DeadLetterPolicy(timeout_s=3.0, retry_every_s=1.0,
                                                             producer_config={
                                                                 "topic.metadata.propagation.max.ms": 1000}))
    _run_until(consumer, handler, lambda: len(handled) == 29, timeout=40)
    time.sleep(1.0)
    consumer.stop()
    consumer.close()
    assert len(handled) == 29, "records after the poison one were still handled"
    assert committed(kafka.bootstrap_servers, conf["group.id"], topic, 1)[0] == 10, \
        "the commit must stop at the record that could not be dead-lettered"


def test_killing_the_group_coordinator_mid_stream_loses_nothing(kafka, make_topic) -> None:
    topic = make_topic(partitions=3)
    values = fill(kafka.bootstrap_servers, topic, 20_000)
    conf = base_conf(kafka)
    handled: list[str] = []
    killed: list[int] = []

    def handler(msg) -> None:
        handled.append(msg.value().decode())
        if len(handled) == 5_000 and not killed:
            admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
            desc = admin.describe_consumer_groups([conf["group.id"]])[conf["group.id"]].result(timeout=10)
            killed.append(desc.coordinator.id)
            kafka.kill(desc.coordinator.id)

    consumer = ReliableConsumer(conf, [topic], commit_interval_s=0.2)
    checked = [0.0]

    def all_handled_and_committed() -> bool:
        # Handled is not enough: if the coordinator's move cost the member its partitions (session
        # timeout), they come back at the last commit and the records after it are handled again
        # before their offsets can be committed. Run until the commits, too, reach the end.
        if len(set(handled)) < 20_000 or time.monotonic() - checked[0] < 1.0:
            return False
        checked[0] = time.monotonic()
        try:
            return sum(committed(kafka.bootstrap_servers, conf["group.id"], topic, 3).values()) == 20_000
        except KafkaException:  # the coordinator is still moving: look again
            return False

    _run_until(consumer, handler, all_handled_and_committed, timeout=150)
    consumer.close()
    assert killed, "the coordinator was never killed"
    assert set(handled) == set(values)
    kafka.start_node(killed[0])
    kafka.wait_healthy()
    assert sum(committed(kafka.bootstrap_servers, conf["group.id"], topic, 3).values()) == 20_000


def test_explicit_api_commits_only_acked_records(kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    fill(kafka.bootstrap_servers, topic, 10)
    conf = base_conf(kafka)
    with ReliableConsumer(conf, [topic]) as consumer:
        got = []
        deadline = time.monotonic() + 30
        while len(got) < 10 and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None:
                got.append(msg)
        for msg in got[:4] + got[5:]:
            consumer.ack(msg)  # offset 4 is never acked
        consumer.commit()
    assert committed(kafka.bootstrap_servers, conf["group.id"], topic, 1)[0] == 4


@pytest.mark.parametrize("by_pattern", [False, True], ids=["two-topics", "regex"])
def test_two_topics_with_the_same_partition_numbers_are_tracked_and_committed_apart(
    kafka, make_topic, by_pattern: bool
) -> None:
    # A fetch can hand over topic A's partition 0 right after topic B's partition 0: the hot path must
    # not take them for one run (it reads no topic when there is only one to read).
    prefix = f"two-{uuid.uuid4().hex[:6]}"
    topics = [make_topic(partitions=2, prefix=prefix) for _ in range(2)]
    values = {t: fill(kafka.bootstrap_servers, t, 600, prefix=t) for t in topics}
    conf = base_conf(kafka)
    subscription = [f"^{prefix}-.*"] if by_pattern else topics
    seen: Counter[bytes] = Counter()
    expected = sum(len(v) for v in values.values())
    with ReliableConsumer(conf, subscription, commit_every=100) as consumer:

        def handler(msg) -> None:
            seen[msg.value()] += 1
            if sum(seen.values()) >= expected:
                consumer.stop()

        runner = threading.Thread(target=consumer.run, args=(handler,), daemon=True)
        runner.start()
        runner.join(90)
        assert not runner.is_alive(), f"handled {sum(seen.values())} of {expected}"
    assert set(seen) == {v.encode() for vs in values.values() for v in vs}
    assert max(seen.values()) == 1
    for t in topics:
        offsets = committed(kafka.bootstrap_servers, str(conf["group.id"]), t, 2)
        counts = Counter(m.partition() for m in consume_all(kafka.bootstrap_servers, t))
        assert offsets == {p: counts[p] for p in range(2)}, (t, offsets, counts)
