"""ReliableConsumer with a dedup store, on real Kafka and a real redis-server: effects happen once.

A re-sending producer and a consumer both SIGKILLed mid-stream apply each original message exactly once
when the effect and the confirmation share one inbox transaction (SQLite or Redis), while an unguarded
control beside them applies some twice; so does a zombie (paused past its session while a new owner
takes its partition over) against the SQLite partition fence; a killed Redis holds progress and forgets
what it knew.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import redis
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.consumer import DedupPolicy, ReliableConsumer
from reliable_kafka.dedup import RedisDedupStore, SQLiteDedupStore
from reliable_kafka.errors import DedupStoreUnavailable
from reliable_kafka.ids import ID_HEADER, message_id_of, new_ids
from reliable_kafka.lab.consumer_crash import BITES, kill_loop
from reliable_kafka.lab.programs.dedup_consumer_proc import EFFECTS_HASH, EFFECTS_TABLE
from reliable_kafka.lab.programs.status import GroupOffsets, MemberStatus
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.testing import LocalKafkaCluster, consume_all
from reliable_kafka.testing.faults import sigkill_producer_mid_stream
from reliable_kafka.testing.gates import fire_when
from reliable_kafka.testing.redis_server import RedisServer
from tests.fixtures.members import MemberLogs

ROOT = Path(__file__).resolve().parents[2]
PRODUCER = [sys.executable, "-m", "reliable_kafka.lab.programs.producer_proc"]
CONSUMER = [sys.executable, "-m", "reliable_kafka.lab.programs.dedup_consumer_proc"]
UNAVAILABLE = "dedup store unavailable"


class TransientError(Exception):
    """What a handler raises on its first attempt."""


def produce(bootstrap: str, topic: str, records: Sequence[tuple[str, str]]) -> None:
    """Write (payload, rk-id) records with a bare producer: the input of the test, not under test."""
    p = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, "linger.ms": 5})
    for value, message_id in records:
        produce_when_room(p, topic, value.encode(), headers=[(ID_HEADER, message_id.encode())])
    assert p.flush(60) == 0


def fresh(prefix: str, n: int) -> list[tuple[str, str]]:
    return list(zip([f"{prefix}-{i}" for i in range(n)], new_ids(n), strict=True))


def committed(bootstrap: str, group: str, topic: str, partitions: int) -> int:
    """The group's committed offsets on the topic, summed (unset partitions count 0)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        got = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=15)
        return sum(max(tp.offset, 0) for tp in got)
    finally:
        c.close()


def conf(kafka: LocalKafkaCluster, group: str) -> dict[str, Any]:
    return {"bootstrap.servers": kafka.bootstrap_servers, "group.id": group,
            "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}


def run_in_thread(consumer: ReliableConsumer, handler: Callable[[Message], None]) -> threading.Thread:
    thread = threading.Thread(target=consumer.run, args=(handler,), daemon=True)
    thread.start()
    return thread


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.02)


def log_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# ---- inbox transactions ------------------------------------------------------------------


@pytest.mark.redis
def test_redis_inbox_applies_the_writes_and_the_confirmation_together_or_not_at_all(redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    with RedisDedupStore(redis_url) as store, RedisDedupStore(redis_url) as other:
        assert store.claim(["a", "b"]).claimed == {"a", "b"}
        with store.inbox(["a"]) as tx:
            assert not tx.already_done
            tx.pipe.hincrby("fx", "a", 1)
            assert raw.hget("fx", "a") is None, "queued writes must wait for EXEC"
        assert raw.hget("fx", "a") == b"1"
        assert other.claim(["a"]).done == {"a"}

        with pytest.raises(TransientError), store.inbox(["b"]) as tx:
            tx.pipe.hincrby("fx", "b", 1)
            raise TransientError
        assert raw.hget("fx", "b") is None
        assert other.claim(["b"]).busy == {"b"}, "a failed inbox must leave the claim, not a confirmation"

        # A retry of an inbox that committed (its reply lost to a timeout, say) writes nothing.
        with store.inbox(["a"]) as tx:
            assert tx.already_done
            tx.pipe.hincrby("fx", "a", 1)
        assert raw.hget("fx", "a") == b"1"
    raw.close()


@pytest.mark.redis
def test_redis_inbox_aborts_when_another_consumer_confirms_its_key_meanwhile(redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    with RedisDedupStore(redis_url) as store, RedisDedupStore(redis_url) as other:
        store.claim(["k"], lease_s=0.05)
        time.sleep(0.15)
        other.claim(["k"])  # our lease ran out and another consumer took the key over
        with pytest.raises(DedupStoreUnavailable, match="changed"), store.inbox(["k"]) as tx:
            tx.pipe.hincrby("fx", "k", 1)
            with other.inbox(["k"]) as theirs:
                theirs.pipe.hincrby("fx", "k", 1)
        assert raw.hget("fx", "k") == b"1", "only the other consumer's effect may be applied"
        with store.inbox(["k"]) as tx:  # the handler's retry finds the key done
            assert tx.already_done
            tx.pipe.hincrby("fx", "k", 1)
        assert raw.hget("fx", "k") == b"1"
    raw.close()


@pytest.mark.redis
def test_a_process_killed_inside_the_redis_inbox_leaves_neither_effect_nor_confirmation(redis_url: str) -> None:
    script = textwrap.dedent(f"""
        import os, signal
        from reliable_kafka.dedup import RedisDedupStore
        store = RedisDedupStore({redis_url!r})
        store.claim(["k"], lease_s=0.3)
        with store.inbox(["k"]) as tx:
            tx.pipe.hincrby("fx", "k", 1)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=False, timeout=60)
    assert proc.returncode == -9
    with redis.Redis.from_url(redis_url) as raw:
        assert raw.hget("fx", "k") is None
    time.sleep(0.5)
    with RedisDedupStore(redis_url) as store:
        assert store.claim(["k"]).claimed == {"k"}, "the dead process's claim must expire, not turn done"


def test_sqlite_inbox_with_keys_writes_nothing_when_they_are_already_done(tmp_path: Path) -> None:
    db = tmp_path / "dedup.db"
    with SQLiteDedupStore(db) as store, SQLiteDedupStore(db) as other:
        with closing(sqlite3.connect(db)) as conn:
            conn.execute("CREATE TABLE fx (payload TEXT)")
            conn.commit()
        store.claim(["a"], lease_s=0.05)
        time.sleep(0.15)
        assert other.claim(["a"]).claimed == {"a"}  # our lease ran out meanwhile
        with other.inbox(["a"]) as tx:
            assert not tx.already_done
            tx.conn.execute("INSERT INTO fx VALUES ('a')")
        with store.inbox(["a"]) as tx:  # the slow first consumer finishes late
            assert tx.already_done
            tx.conn.execute("INSERT INTO fx VALUES ('a')")
        with closing(sqlite3.connect(db)) as conn:
            assert conn.execute("SELECT count(*) FROM fx").fetchone() == (1,)
        assert store.claim(["a"]).done == {"a"}


# ---- the consumer ------------------------------------------------------------------------

@pytest.mark.cluster
@pytest.mark.redis
def test_an_inbox_handler_confirms_its_key_and_the_consumers_own_confirm_changes_nothing(
    kafka: LocalKafkaCluster, make_topic: Callable[..., str], redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    topic = make_topic(partitions=2)
    originals = fresh("c", 200)
    copies = random.Random(5).sample(originals, 50)  # re-sent with the same rk-id
    produce(kafka.bootstrap_servers, topic, originals + copies)
    group = f"inbox-{uuid.uuid4().hex[:6]}"
    store = RedisDedupStore(redis_url, prefix="coop:")
    consumer = ReliableConsumer(conf(kafka, group), [topic], dedup=store, commit_interval_s=0.2)
    handled: list[str] = []

    def handler(msg: Message) -> None:
        with store.inbox([consumer.dedup_key_of(msg)]) as tx:  # type: ignore[list-item]
            tx.pipe.hincrby("coop:fx", msg.value(), 1)  # type: ignore[arg-type]
        handled.append(msg.value().decode())  # type: ignore[union-attr]

    with caplog.at_level(logging.WARNING, logger="reliable_kafka"):
        thread = run_in_thread(consumer, handler)
        wait_for(lambda: len(handled) + consumer.stats().duplicates_skipped >= 250, 60, "250 records")
        wait_for(lambda: committed(kafka.bootstrap_servers, group, topic, 2) == 250, 30, "the commit of 250")
        consumer.stop()
        thread.join(30)
    consumer.close()
    with redis.Redis.from_url(redis_url) as raw:
        effects = {k.decode(): int(v) for k, v in raw.hgetall("coop:fx").items()}
        states = raw.mget([f"coop:{message_id}" for _, message_id in originals])
    store.close()
    assert effects == {value: 1 for value, _ in originals}
    assert consumer.stats().duplicates_skipped == 50
    assert set(states) == {b"done"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "dedup_fail_open" not in r.getMessage()]


def _produce_with_kills(kafka: LocalKafkaCluster, topic: str, workdir: Path, total: int, kills: int,
                        rng: random.Random, log_path: Path) -> tuple[set[str], int]:
    """The outbox producer, SIGKILLed `kills` times mid-stream and restarted after its ledger each time.

    Each kill fires once the producer has accepted a random 1,000 to 2,500 more messages and holds some
    undelivered (2 kills take at most 5,000 of the 8,000), never a fixed time after its start."""
    ledger, status = workdir / "producer.ledger", workdir / "producer.status"

    def start(first: int) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as out:  # appended across restarts
            return subprocess.Popen(PRODUCER + ["--mode", "reliable", "--bootstrap", kafka.bootstrap_servers,
                                                "--topic", topic, "--outbox", str(workdir / "outbox.db"),
                                                "--start", str(first), "--end", str(total), "--ledger",
                                                str(ledger), "--status", str(status)],
                                    cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    crashes = sigkill_producer_mid_stream(start, ledger, status, kills=kills, between=(1_000, 2_500), rng=rng,
                                          what="outbox producer")
    assert crashes.exit_code == 0, f"the producer's last run did not finish cleanly (exit {crashes.exit_code})"
    return {f"v-{i}" for i in crashes.accepted}, crashes.kills


def _consume_with_kills(command: list[str], status_file: Path, offsets: GroupOffsets, log_path: Path, kills: int,
                        rng: random.Random, producer_done: threading.Event, top_up: Callable[[], None]) -> int:
    """Run a consumer child and SIGKILL it `kills` times, each once it applied 100 to 400 records in its
    life and holds applied records its group has not committed (so it dies mid-stream and those are
    redelivered); then run it once more, after the producer finished, until it stops by itself."""

    def spawn(final: bool) -> subprocess.Popen[bytes]:
        # A life that is to be killed must not stop by itself while it waits for the producer (it
        # restarts too); the final one stops once it has been idle for the command's --idle.
        idle = [] if final else ["--idle", "120"]
        with log_path.open("ab") as out:
            return subprocess.Popen(command + ["--status-file", str(status_file)] + idle, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT)

    done, code = kill_loop(spawn, what=f"consumer {log_path.stem}", bite=BITES["reliable"], status_file=status_file,
                           offsets=offsets, kills=kills, rng=rng, min_handled=(100, 400), top_up=top_up,
                           before_final=lambda: producer_done.wait(150), final_timeout_s=150)
    assert code == 0, f"consumer {log_path.stem}'s final run exited {code}"
    return done


def _sqlite_effects(db: Path) -> Callable[[], Counter[str]]:
    """How many times each payload was applied, from a child's SQLite effects table."""

    def applied() -> Counter[str]:
        for _ in range(50):
            try:
                with closing(sqlite3.connect(db, timeout=5)) as conn:
                    rows = conn.execute(f"SELECT payload, count(*) FROM {EFFECTS_TABLE} GROUP BY payload").fetchall()
                return Counter({payload: n for payload, n in rows})
            except sqlite3.OperationalError as exc:
                if "no such table" in str(exc):  # the child has not started yet
                    return Counter()
                time.sleep(0.1)  # locked: a killed writer's WAL is being recovered
        raise AssertionError(f"cannot read the effects in {db}")

    return applied


def _redis_effects(url: str, prefix: str) -> Callable[[], Counter[str]]:
    """How many times each payload was applied, from a child's Redis effects hash."""

    def applied() -> Counter[str]:
        with redis.Redis.from_url(url) as raw:
            return Counter({k.decode(): int(v) for k, v in raw.hgetall(prefix + EFFECTS_HASH).items()})

    return applied


@pytest.mark.cluster
@pytest.mark.parametrize("store", ["sqlite", pytest.param("redis", marks=pytest.mark.redis)])
def test_killed_producer_and_consumer_apply_each_original_message_exactly_once(
    store: str, kafka: LocalKafkaCluster, make_topic: Callable[..., str], tmp_path: Path,
    request: pytest.FixtureRequest, member_logs: MemberLogs,
) -> None:
    topic = make_topic(partitions=3)
    rng = random.Random(17)
    ours_db, control_db = tmp_path / "dedup.db", tmp_path / "control.db"
    common = ["--bootstrap", kafka.bootstrap_servers, "--topic", topic, "--idle", "4"]
    ours = CONSUMER + common + ["--store", store, "--instance-id", "ours", "--lease-s", "3"]
    if store == "sqlite":
        ours += ["--db", str(ours_db)]
        ours_effects = _sqlite_effects(ours_db)
    else:
        redis_url = request.getfixturevalue("redis_url")
        prefix = f"crash-{uuid.uuid4().hex[:6]}:"
        ours += ["--redis-url", redis_url, "--redis-prefix", prefix]
        ours_effects = _redis_effects(redis_url, prefix)
    control_effects = _sqlite_effects(control_db)
    ours_group, control_group = f"ours-{uuid.uuid4().hex[:6]}", f"control-{uuid.uuid4().hex[:6]}"
    ours += ["--group", ours_group]
    control = CONSUMER + common + ["--store", "none", "--group", control_group,
                                   "--instance-id", "control", "--db", str(control_db)]

    producer_done = threading.Event()
    produced: dict[str, Any] = {}

    def producer() -> None:
        try:
            produced["accepted"], produced["kills"] = _produce_with_kills(kafka, topic, tmp_path, 8_000, 2,
                                                                          random.Random(18),
                                                                          member_logs.path("producer"))
        finally:
            producer_done.set()

    def top_up() -> None:  # only if a kill's condition did not come: the consumers ran out of input
        produce(kafka.bootstrap_servers, topic, fresh(f"top-{uuid.uuid4().hex[:4]}", 500))

    producer_thread = threading.Thread(target=producer, daemon=True)
    producer_thread.start()
    started = time.monotonic()
    control_kills: list[int] = []
    with GroupOffsets(kafka.bootstrap_servers, ours_group, topic, 3) as ours_offsets, \
            GroupOffsets(kafka.bootstrap_servers, control_group, topic, 3) as control_offsets:
        control_thread = threading.Thread(target=lambda: control_kills.append(_consume_with_kills(
            control, tmp_path / "control.status.json", control_offsets, member_logs.path("control"), 3,
            random.Random(19), producer_done, top_up)), daemon=True)
        control_thread.start()
        consumer_kills = _consume_with_kills(ours, tmp_path / "ours.status.json", ours_offsets,
                                             member_logs.path("ours"), 3, rng, producer_done, top_up)
        control_thread.join(200)
    producer_thread.join(60)
    assert "accepted" in produced, "the producer loop failed"

    # The independent reader: each distinct rk-id is one original message; its payload must be applied
    # as many times as there are distinct originals carrying it (an app-level re-send after a kill,
    # before the ledger line, is a new original with a new id).
    originals: dict[str, set[str | None]] = defaultdict(set)
    records = 0
    for m in consume_all(kafka.bootstrap_servers, topic):
        originals[m.value().decode()].add(message_id_of(m.headers()))
        records += 1
    expected = Counter({payload: len(ids) for payload, ids in originals.items()})
    applied, control_applied = ours_effects(), control_effects()

    resent = records - sum(expected.values())
    missing_from_topic = produced["accepted"] - expected.keys()
    lost = sum(max(0, expected[p] - applied[p]) for p in expected)
    double = sum(max(0, applied[p] - expected[p]) for p in applied)
    control_lost = sum(max(0, expected[p] - control_applied[p]) for p in expected)
    control_double = sum(max(0, control_applied[p] - expected[p]) for p in control_applied)
    print(f"{store} ({time.monotonic() - started:.0f}s): {records} records, {len(expected)} payloads, {resent} "
          f"outbox re-sends, producer kills {produced['kills']}, consumer kills {consumer_kills}; "
          f"ours lost={lost} double={double}; control lost={control_lost} double={control_double}")
    assert consumer_kills == 3 and control_kills == [3]
    assert produced["kills"] == 2
    assert not missing_from_topic, f"{len(missing_from_topic)} accepted messages are not in the topic"
    assert (lost, double) == (0, 0), f"lost={lost} double-applied={double}"
    assert control_lost == 0
    assert control_double > 0, "the unguarded control applied nothing twice: the faults did not bite"


def _stop_outside_a_transaction(pid: int, db: Path) -> None:
    """SIGSTOP `pid` at a moment it holds no write transaction on `db`. Stopped inside one, it would keep
    SQLite's write lock and every other writer of the file would wait for it (a new owner could not even
    take its lease): a different case from the one tested. Bounded: 200 tries, each a few milliseconds."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 2
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, f"process {pid} did not stop"
            time.sleep(0.001)
        try:
            with closing(sqlite3.connect(db, timeout=0)) as probe:
                probe.execute("BEGIN IMMEDIATE")
                probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:  # locked: stopped inside a transaction; let it finish, try again
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.002)
    raise AssertionError(f"process {pid} was inside a transaction on {db} at each of 200 tries")


def _zombie(kafka: LocalKafkaCluster, topic: str, payloads: set[str], store: str, workdir: Path,
            member_logs: MemberLogs) -> tuple[Counter[str], str, int]:
    """One owner of the topic's only partition is SIGSTOPped (between two store transactions) once it has
    handled 300 records it has not committed; a second member joins, gets the partition when the first
    one's session (6 s) expires and processes it; once it has handled 200, the first is resumed (SIGCONT)
    with the rest of its batch. Both are stopped (SIGTERM) once every payload was applied. Returns the
    effects, the old owner's log and how many records it handled after it was resumed."""
    group = f"zombie-{store}-{uuid.uuid4().hex[:6]}"
    db = workdir / f"zombie-{store}.db"
    applied = _sqlite_effects(db)
    base = CONSUMER + ["--bootstrap", kafka.bootstrap_servers, "--topic", topic, "--group", group, "--store",
                       store, "--db", str(db), "--idle", "120"]
    children: list[subprocess.Popen[bytes]] = []

    def spawn(name: str, *extra: str) -> Path:
        status = workdir / f"zombie-{store}-{name}.status.json"
        with member_logs.path(f"{store}-{name}").open("ab") as out:
            children.append(subprocess.Popen(base + ["--status-file", str(status), *extra], cwd=ROOT, stdout=out,
                                             stderr=subprocess.STDOUT))
        return status

    def handled(status: Path) -> int:
        st = MemberStatus.read(status)
        return 0 if st is None else st.handled

    old_status = spawn("old", "--handle-delay-s", "0.003")  # slow: always in the middle of a batch
    old = children[0]
    try:
        with GroupOffsets(kafka.bootstrap_servers, group, topic, 1) as offsets:
            def old_mid_stream() -> bool:
                st = MemberStatus.read(old_status)
                return st is not None and st.handled >= 300 and st.uncommitted(offsets.get()) > 0

            fire_when(old_mid_stream, lambda: _stop_outside_a_transaction(old.pid, db),
                      what=f"{store}: pause the owner mid-stream", timeout_s=60)
        new_status = spawn("new")
        at_resume = [0]

        def resume() -> None:
            at_resume[0] = handled(old_status)  # stopped: its status is what it had handled when paused
            os.kill(old.pid, signal.SIGCONT)

        fire_when(lambda: handled(new_status) >= 200, resume,
                  what=f"{store}: resume the old owner once the new one processes", timeout_s=60)
        wait_for(lambda: applied().keys() >= payloads, 90, f"{store}: every payload applied")
    finally:
        for child in children:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                child.terminate()
        for child in children:
            try:
                child.wait(60)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
    return applied(), member_logs.path(f"{store}-old").read_text(), handled(old_status) - at_resume[0]


@pytest.mark.cluster
def test_a_zombie_owner_resumed_after_a_takeover_applies_nothing_twice_behind_the_partition_fence(
    kafka: LocalKafkaCluster, make_topic: Callable[..., str], tmp_path: Path, member_logs: MemberLogs,
) -> None:
    topic = make_topic(partitions=1)
    records = fresh("z", 1500)
    produce(kafka.bootstrap_servers, topic, records)
    payloads = {value for value, _ in records}
    runs: dict[str, tuple[Counter[str], str, int]] = {}
    # The control (no dedup: the same effects, committed alone) runs beside ours on the same topic.
    control = threading.Thread(target=lambda: runs.__setitem__(
        "none", _zombie(kafka, topic, payloads, "none", tmp_path, member_logs)), daemon=True)
    control.start()
    runs["sqlite"] = _zombie(kafka, topic, payloads, "sqlite", tmp_path, member_logs)
    control.join(150)
    assert "none" in runs, "the control run failed"

    def counts(applied: Counter[str]) -> tuple[int, int]:
        return len(payloads - applied.keys()), sum(n - 1 for n in applied.values() if n > 1)

    (lost, double), (_, old_log, handled_after_resume) = counts(runs["sqlite"][0]), runs["sqlite"]
    control_lost, control_double = counts(runs["none"][0])
    print(f"zombie: ours lost={lost} double={double}; control lost={control_lost} double={control_double}")
    assert (lost, double) == (0, 0), f"lost={lost} double-applied={double}"
    # A resumed owner that handled the rest of its batch met the fence when it recorded it. Paused right
    # after its batch's last record it has nothing to record (the group revokes the partition first), and
    # its count after the resume is only its status file catching up: written every 50 ms, about 17
    # records at 3 ms each; 100 leaves room for a starved status thread.
    assert handled_after_resume < 100 or "taken over by another consumer" in old_log, \
        f"the resumed owner handled {handled_after_resume} more records and was never fenced"
    assert control_lost == 0
    assert control_double > 0, "the unguarded zombie applied nothing twice: the pause did not bite"


# ---- store outages -----------------------------------------------------------------------


class RecordingRedisStore(RedisDedupStore):
    """The real Redis store, noting every key whose confirmation Redis acknowledged, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.confirmed: list[str] = []

    def confirm(self, keys: Sequence[str]) -> None:
        super().confirm(keys)
        self.confirmed.extend(keys)


@pytest.mark.cluster
@pytest.mark.redis
def test_redis_killed_for_10s_holds_progress_loses_nothing_and_forgets_what_it_knew(
    kafka: LocalKafkaCluster, make_topic: Callable[..., str], own_redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = make_topic(partitions=3)
    n = 4000
    records = fresh("r", n)
    produce(kafka.bootstrap_servers, topic, records)
    group = f"outage-{uuid.uuid4().hex[:6]}"
    store = RecordingRedisStore(own_redis_server.url, socket_timeout_s=0.5)
    consumer = ReliableConsumer(conf(kafka, group), [topic], dedup=store, dedup_lease_s=5, commit_interval_s=0.2)
    handled: list[str] = []

    def handler(msg: Message) -> None:
        time.sleep(0.001)
        handled.append(msg.value().decode())  # type: ignore[union-attr]

    with caplog.at_level(logging.INFO, logger="reliable_kafka"):
        thread = run_in_thread(consumer, handler)
        try:
            # Mid-work: 500 keys confirmed and at least 1,000 records still to handle, so the outage
            # holds real work back (the handler needs about 1 ms a record).
            fire_when(lambda: len(store.confirmed) >= 500 and len(set(handled)) <= n - 1_000,
                      own_redis_server.kill, what="redis kill after 500 confirmed keys", timeout_s=90)
            killed_at = time.monotonic()
            forgotten = list(store.confirmed)  # acknowledged by the server that just died
            time.sleep(3.0)  # the batch claimed before the kill finishes; nothing after it may run
            during = [(len(handled), committed(kafka.bootstrap_servers, group, topic, 3))]
            time.sleep(max(0.0, killed_at + 9.5 - time.monotonic()))
            during.append((len(handled), committed(kafka.bootstrap_servers, group, topic, 3)))
            time.sleep(max(0.0, killed_at + 10.0 - time.monotonic()))
            own_redis_server.restart()  # empty: it kept nothing on disk
            remembered_from = len(store.confirmed)
            wait_for(lambda: len(set(handled)) == n, 90, "every record after the restart")
            wait_for(lambda: len(store.confirmed) >= remembered_from + 100, 30, "confirmations after the restart")

            # Re-send 100 messages confirmed before the kill and 100 confirmed after the restart.
            by_id = {message_id: value for value, message_id in records}
            old = random.Random(1).sample(forgotten, 100)
            new = random.Random(2).sample(store.confirmed[remembered_from:], 100)
            produce(kafka.bootstrap_servers, topic, [(by_id[k], k) for k in old + new])
            wait_for(lambda: len(handled) + consumer.stats().duplicates_skipped >= n + 200, 60,
                     "the 200 re-sent copies")
        finally:
            consumer.stop()
            thread.join(30)
            consumer.close()
            store.close()

    assert during[0] == during[1], f"progress while the store was down: (handled, committed) {during}"
    assert during[0][1] < n
    times = Counter(handled)
    assert set(times) == {value for value, _ in records}, "lost records"
    # The restarted Redis had forgotten the first confirmations: those copies ran again. The copies
    # of keys confirmed after the restart were caught.
    assert sorted(times[by_id[k]] for k in old) == [2] * 100
    assert sorted(times[by_id[k]] for k in new) == [1] * 100
    assert sum(times.values()) - n == 100
    assert consumer.stats().duplicates_skipped == 100
    assert len(log_lines(caplog, UNAVAILABLE)) == 1, log_lines(caplog, UNAVAILABLE)
    assert len(log_lines(caplog, "dedup store is back")) == 1


@pytest.mark.cluster
@pytest.mark.redis
def test_fail_open_keeps_processing_without_the_store_and_warns_once(
    kafka: LocalKafkaCluster, make_topic: Callable[..., str], own_redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = make_topic(partitions=2)
    n = 1500
    records = fresh("o", n)
    produce(kafka.bootstrap_servers, topic, records)
    group = f"open-{uuid.uuid4().hex[:6]}"
    store = RedisDedupStore(own_redis_server.url, socket_timeout_s=0.5)
    handled: list[str] = []

    def handler(msg: Message) -> None:
        time.sleep(0.001)
        handled.append(msg.value().decode())  # type: ignore[union-attr]

    with caplog.at_level(logging.WARNING, logger="reliable_kafka"):
        consumer = ReliableConsumer(conf(kafka, group), [topic], dedup=store, dedup_fail_open=True,
                                    commit_interval_s=0.2)
        thread = run_in_thread(consumer, handler)
        try:
            fire_when(lambda: len(handled) >= 300 and len(set(handled)) <= n - 500, own_redis_server.kill,
                      what="redis kill after 300 records (fail-open)", timeout_s=60)
            wait_for(lambda: len(set(handled)) == n, 60, "every record while the store is down")
            wait_for(lambda: committed(kafka.bootstrap_servers, group, topic, 2) == n, 30, "the commit of all")
        finally:
            consumer.stop()
            thread.join(30)
            consumer.close()
            store.close()
    assert len(handled) == n
    assert len(log_lines(caplog, UNAVAILABLE)) == 1
    assert "processing without dedup" in log_lines(caplog, UNAVAILABLE)[0]


# ---- failures and busy keys --------------------------------------------------------------


@pytest.mark.cluster
def test_a_handler_that_fails_once_releases_its_claim_and_its_effect_happens_once(
    kafka: LocalKafkaCluster, make_topic: Callable[..., str], tmp_path: Path,
) -> None:
    topic = make_topic(partitions=1)
    records = fresh("f", 20)
    produce(kafka.bootstrap_servers, topic, records)
    group = f"fail-{uuid.uuid4().hex[:6]}"
    db = tmp_path / "dedup.db"
    lease_s = 120.0  # a claim that was not released would hold the record back for two minutes
    attempts: Counter[str] = Counter()
    effects: Counter[str] = Counter()
    first = ReliableConsumer(conf(kafka, group), [topic], dedup=SQLiteDedupStore(db), dedup_lease_s=lease_s,
                             retry=RetryPolicy(attempts=5, initial_backoff_s=30, max_backoff_s=30, jitter=False))

    def failing_once(msg: Message) -> None:
        value = msg.value().decode()  # type: ignore[union-attr]
        attempts[value] += 1
        if value == "f-7" and attempts[value] == 1:
            first.stop()  # the process is asked to stop while f-7 waits for its retry
            raise TransientError("f-7 fails once")
        effects[value] += 1

    first.run(failing_once, stop_after=60)
    first.close()
    assert effects["f-7"] == 0 and attempts["f-7"] == 1

    second_store = SQLiteDedupStore(db)  # a new process: a new owner
    second = ReliableConsumer(conf(kafka, group), [topic], dedup=second_store, dedup_lease_s=lease_s)
    started = time.monotonic()

    def stop_when_f7_ran() -> None:
        deadline = time.monotonic() + 60
        while effects["f-7"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        second.stop()

    threading.Thread(target=stop_when_f7_ran, daemon=True).start()
    second.run(failing_once, stop_after=90)
    took = time.monotonic() - started
    second.close()
    assert effects == Counter({value: 1 for value, _ in records})
    assert attempts["f-7"] == 2
    assert took < lease_s / 2, f"f-7 waited {took:.0f}s: its claim was not released"
    assert second.stats().duplicates_skipped == 12, "the records after f-7 were confirmed by the first run"
    assert second_store.claim([message_id for _, message_id in records]).done == {k for _, k in records}
    second_store.close()
    assert committed(kafka.bootstrap_servers, group, topic, 1) == 20


@pytest.mark.cluster
def test_a_key_busy_under_another_consumers_claim_holds_its_partition_in_order(
    kafka: LocalKafkaCluster, make_topic: Callable[..., str], tmp_path: Path,
) -> None:
    topic = make_topic(partitions=1)
    records = fresh("b", 10)
    produce(kafka.bootstrap_servers, topic, records)
    db = tmp_path / "dedup.db"
    with SQLiteDedupStore(db) as other:
        other.claim([records[4][1]], lease_s=3.0)  # a program outside the group is on b-4 (and dies)
    claimed_at = time.monotonic()
    store = SQLiteDedupStore(db)
    # fence=False: keys shared with programs outside the group need per-key claims (the fence is per group).
    consumer = ReliableConsumer(conf(kafka, f"busy-{uuid.uuid4().hex[:6]}"), [topic],
                                dedup=DedupPolicy(store, fence=False))
    handled: list[tuple[str, float]] = []

    def handler(msg: Message) -> None:
        handled.append((msg.value().decode(), time.monotonic()))  # type: ignore[union-attr]
        if len(handled) == 10:
            consumer.stop()

    consumer.run(handler, stop_after=60)
    consumer.close()
    store.close()
    assert [value for value, _ in handled] == [value for value, _ in records], "the partition ran out of order"
    assert handled[4][1] - claimed_at >= 2.9, "b-4 ran while another consumer's claim held it"
