"""Lab scenario `eos-copier-bounce` (failure mode L8): a Kafka-to-Kafka copier is SIGKILLed mid-copy.

The at-least-once control copies records it had produced but not yet committed a second time after
each restart; TransactionalProcessor commits outputs and offsets in one transaction, so its output,
read with read_committed, holds every input exactly once. Also the copier child program and its driver.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition

from reliable_kafka.config import consumer_config, producer_config
from reliable_kafka.errors import TransactionFailed, TransactionFenced
from reliable_kafka.ids import ID_HEADER, message_id_of, new_ids
from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import result_from, topic_name
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.testing.cluster import LocalKafkaCluster, consume_all
from reliable_kafka.transactions import CommitInfo, OutputRecord, TransactionalProcessor

log = logging.getLogger(__name__)

NAME = "eos-copier-bounce"
MESSAGES = 5_000
KILLS = 3
# Where the copier's code lives, so a child started from anywhere imports this same copy of it.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# ---- the two copiers ---------------------------------------------------------------------------


class AtLeastOnceCopier:
    """The control, and the benchmark's baseline: a plain confluent-kafka copier, at-least-once.

    Records are copied (value, key, headers) with an idempotent acks=all producer; every
    `commit_interval_s` the producer is flushed and only then are the consumed offsets committed. A
    crash between the two copies again what was produced since the last commit: duplicates, no loss.
    """

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        group_id: str,
        input_topic: str,
        output_topic: str,
        commit_interval_s: float = 0.1,
        delay_s: float = 0.0,
        consumer_overrides: Mapping[str, Any] | None = None,
        on_commit: Callable[[CommitInfo], None] | None = None,
    ) -> None:
        self._consumer = Consumer(consumer_config(
            {"bootstrap.servers": bootstrap_servers, "group.id": group_id, **dict(consumer_overrides or {})}
        ))
        self._producer = Producer(producer_config({"bootstrap.servers": bootstrap_servers}))
        self._input, self._output = input_topic, output_topic
        self._interval, self._delay = commit_interval_s, delay_s
        self._on_commit = on_commit
        self._stopping = threading.Event()
        self._offsets: dict[tuple[str, int], int] = {}
        self._copied = 0

    def run(self) -> None:
        """Copy until stop(); commits what was copied before returning."""
        consumer, producer, output, delay = self._consumer, self._producer, self._output, self._delay
        consumer.subscribe([self._input], on_revoke=lambda _c, _p: self._commit())
        last_commit = time.monotonic()
        while not self._stopping.is_set():
            for msg in consumer.consume(num_messages=500, timeout=0.1):
                if msg.error() is not None:
                    continue
                if delay:
                    time.sleep(delay)
                while True:
                    try:
                        producer.produce(output, msg.value(), msg.key(), headers=msg.headers())
                        break
                    except BufferError:
                        producer.poll(0.05)
                self._offsets[(msg.topic() or "", msg.partition() or 0)] = (msg.offset() or 0) + 1
                self._copied += 1
            producer.poll(0)
            if time.monotonic() - last_commit >= self._interval:
                self._commit()
                last_commit = time.monotonic()
        self._commit()

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        self._consumer.close()
        self._producer.flush(30)

    def _commit(self) -> None:
        if not self._offsets:
            return
        self._producer.flush(60)  # outputs first: an offset is committed only for copied records
        offsets, copied = self._offsets, self._copied
        self._offsets, self._copied = {}, 0
        try:
            self._consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in offsets.items()], asynchronous=False
            )
        except KafkaException as exc:  # a rebalance: the next owner copies these again
            log.warning("control copier commit failed: %s", exc)
            return
        if self._on_commit is not None:
            self._on_commit(CommitInfo(offsets, copied, copied, 0))


def copy_transform(output_topic: str, delay_s: float = 0.0) -> Callable[[Message], tuple[OutputRecord]]:
    """The transform of the exactly-once copier: the record as it is, into `output_topic`."""

    def transform(msg: Message) -> tuple[OutputRecord]:
        if delay_s:
            time.sleep(delay_s)
        return (OutputRecord(output_topic, msg.value(), msg.key(), msg.headers()),)

    return transform


# ---- the copier as a child process ------------------------------------------------------------


class _Reporter:
    """Prints one JSON line per event on stdout: how far this incarnation of the copier got."""

    def __init__(self, ends: Mapping[tuple[str, int], int]) -> None:
        self._ends = ends
        self._latest: dict[tuple[str, int], int] = {}
        self._copied = 0

    def event(self, name: str, **fields: Any) -> None:
        print(json.dumps({"event": name, **fields}), flush=True)

    def committed(self, info: CommitInfo) -> None:
        self._latest.update(info.offsets)
        self._copied += info.messages
        remaining = sum(max(0, self._ends.get(tp, 0) - offset) for tp, offset in self._latest.items())
        total = self._copied + remaining
        self.event("commit", copied=self._copied, progress=self._copied / total if total else 0.0)


def _end_offsets(bootstrap: str, topic: str) -> dict[tuple[str, int], int]:
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": f"rk-probe-{uuid.uuid4().hex[:8]}"})
    try:
        parts = probe.list_topics(topic, timeout=30).topics[topic].partitions
        return {(topic, p): probe.get_watermark_offsets(TopicPartition(topic, p), timeout=30)[1] for p in parts}
    finally:
        probe.close()


def copier_main(argv: Sequence[str] | None = None) -> int:
    """The copier child: `python -m reliable_kafka.lab.eos_copier_bounce --mode eos|control ...`.

    Stops gracefully on SIGTERM (exit 0); exits 3 when fenced, 4 on another transactional failure.
    """
    ap = argparse.ArgumentParser(description=copier_main.__doc__)
    ap.add_argument("--mode", choices=["eos", "control"], required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--instance", required=True, help="stable instance name: the transactional.id suffix")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="pause per record, to stretch the copy")
    ap.add_argument("--static-membership", action="store_true",
                    help="use the instance name as group.instance.id: a restart rejoins without a rebalance")
    ap.add_argument("--session-timeout-ms", type=int, default=6_000)
    ap.add_argument("--transaction-timeout-ms", type=int, default=60_000)
    args = ap.parse_args(argv)
    # A stop that overruns its time gets SIGUSR1 before SIGKILL: every thread's stack goes to stderr,
    # so the log says where the copier was blocked.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {args.instance} %(levelname)s %(name)s: %(message)s")

    reporter = _Reporter(_end_offsets(args.bootstrap, args.input))
    # max.poll.interval.ms is also the group's rebalance timeout: a member that does not rejoin (blocked in
    # a transactional call while a coordinator moves) holds every other member's partitions for that long.
    # 60 s, just above the processor's retry deadline for one call, keeps a bounce from stalling the copy
    # for the default five minutes; a member kicked out by it loses its partitions, aborts, and rejoins.
    consumer_overrides: dict[str, Any] = {"session.timeout.ms": args.session_timeout_ms,
                                          "max.poll.interval.ms": 60_000}
    if args.static_membership:
        consumer_overrides["group.instance.id"] = args.instance
    delay = args.delay_ms / 1000
    copier: TransactionalProcessor | AtLeastOnceCopier
    if args.mode == "control":
        copier = AtLeastOnceCopier(
            args.bootstrap, group_id=args.group, input_topic=args.input, output_topic=args.output,
            delay_s=delay, consumer_overrides=consumer_overrides, on_commit=reporter.committed,
        )
    else:
        copier = TransactionalProcessor(
            {"bootstrap.servers": args.bootstrap},
            group_id=args.group,
            input_topics=[args.input],
            transform=copy_transform(args.output, delay),
            transactional_id=f"{args.group}-{args.instance}",
            consumer_overrides=consumer_overrides,
            producer_overrides={"transaction.timeout.ms": args.transaction_timeout_ms},
            on_commit=reporter.committed,
        )
    signal.signal(signal.SIGTERM, lambda *_: copier.stop())
    try:
        if isinstance(copier, TransactionalProcessor):
            copier.start()
        reporter.event("started", pid=os.getpid())
        copier.run()
    except TransactionFenced as exc:
        log.error("copier fenced: %s", exc)
        reporter.event("fenced", error=str(exc))
        return 3
    except TransactionFailed as exc:
        log.exception("copier failed: %s", exc)
        reporter.event("failed", error=str(exc))
        return 4
    finally:
        copier.close()
    reporter.event("stopped")
    return 0


class CopierProcess:
    """Drives one copier child: start, SIGKILL, restart (same instance name), stop; reads its progress.

    Only the pid this object started is ever signalled.
    """

    def __init__(self, args: Sequence[str], *, module: str = __name__, name: str = "copier") -> None:
        self.name = name
        self.kills = 0
        self._argv = [sys.executable, "-m", module, *args]
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._progress = 0.0
        self._started = threading.Event()
        self._events: list[dict[str, Any]] = []
        self.stop_overran = False  # the last stop() had to SIGKILL: the graceful stop took too long

    def start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
        with self._lock:
            self._progress = 0.0
            self._started.clear()
        self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        assert self._proc.stdout is not None
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True,
                         name=f"{self.name}-stdout").start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                self._events.append(event)
                if event.get("event") == "commit":
                    self._progress = float(event["progress"])
            if event.get("event") == "started":
                self._started.set()

    @property
    def progress(self) -> float:
        """How far the current incarnation got through the input left when it started (0..1)."""
        with self._lock:
            return self._progress

    def events(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self._events if e.get("event") == name]

    def wait_started(self, timeout: float = 60.0) -> bool:
        return self._started.wait(timeout)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the child: no flush, no commit, no goodbye to the group or the coordinator."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
            self.kills += 1

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the copier commits and leaves the group), SIGKILL after `timeout`; returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            # A copier restarted a moment ago may still be importing: before its SIGTERM handler is in
            # place a SIGTERM kills it outright (exit -15) instead of stopping it gracefully.
            self._started.wait(timeout)
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.stop_overran = True
                log.warning("%s did not stop within %.0fs of SIGTERM; its stacks follow, then SIGKILL", self.name,
                            timeout)
                proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                proc.kill()
                proc.wait()
        return proc.returncode


def group_lag(bootstrap: str, group: str, topic: str) -> int:
    """Records of `topic` that `group` has not committed yet (stable offsets: open transactions resolved)."""
    ends = _end_offsets(bootstrap, topic)
    probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "isolation.level": "read_committed",
                      "enable.auto.commit": False})
    try:
        parts = [TopicPartition(t, p) for t, p in ends]
        # A new group's coordinator may still be loading, or moving while a broker is down.
        committed = retry_kafka_call(lambda: probe.committed(parts, timeout=30), deadline_s=90,
                                     what=f"committed offsets of {group}")
    finally:
        probe.close()
    done = {(tp.topic, tp.partition): max(tp.offset, 0) for tp in committed}
    return sum(end - done.get(tp, 0) for tp, end in ends.items())


def kill_rounds(
    copiers: Sequence[CopierProcess],
    *,
    rounds: int,
    at_progress: float,
    finished: Callable[[], bool],
    deadline_s: float,
    seed: int = 7,
    aim: Callable[[CopierProcess], bool] | None = None,
) -> Iterator[CopierProcess]:
    """Kafka's TransactionsTest bounce: each round, SIGKILL each copier once its current incarnation
    has made `at_progress` progress, and restart it. Yields each copier right after its restart.

    Progress is reported at commits, so each kill waits a random 0-0.5 s more: it should land inside
    a transaction, not right after one. Stops early when `finished()` says the copy is done (a kill
    then proves nothing) or the deadline passes. `aim(copier)`, when given, is polled for up to 2 s after
    that wait, and the kill comes as soon as it says yes (e.g. "the output has records of an open
    transaction"), so fewer kills land between two transactions.
    """
    rng = random.Random(seed)
    deadline = time.monotonic() + deadline_s
    for _ in range(rounds):
        for copier in copiers:
            next_check = 0.0
            while copier.progress < at_progress:
                if time.monotonic() > deadline:
                    return
                if time.monotonic() >= next_check:  # finished() asks the brokers: not every tick
                    if finished():
                        return
                    next_check = time.monotonic() + 1.0
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 0.5))
            if aim is not None:
                aim_until = time.monotonic() + 2
                while time.monotonic() < aim_until and not aim(copier):
                    pass
            copier.restart()
            yield copier


def seed_input(bootstrap: str, topic: str, n: int, *, start: int = 0, keys: int = 50) -> list[bytes]:
    """Append n unique values "k<key>:<seq>" keyed by k<key>, each with its own rk-id, to `topic`.

    Values number on from `start`, so topping up the input keeps every key's sequence increasing.
    """
    values = [f"k{i % keys:03d}:{i // keys:06d}".encode() for i in range(start, start + n)]
    producer = Producer(producer_config({"bootstrap.servers": bootstrap, "linger.ms": 20}))
    for value, mid in zip(values, new_ids(n), strict=True):
        while True:
            try:
                producer.produce(topic, value, value.split(b":")[0], headers=[(ID_HEADER, mid.encode())])
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(60):
        raise RuntimeError(f"seeding {topic} did not finish")
    return values


# ---- the scenario ------------------------------------------------------------------------------


def run(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    bs = cluster.bootstrap_servers
    started = time.monotonic()
    source = topic_name(NAME, "input")
    cluster.create_topic(source, 2)
    progress("seeding the input", 0.02)
    values = seed_input(bs, source, MESSAGES)
    runs: dict[str, tuple[str, str, CopierProcess]] = {}
    for client, mode in ((CONTROL, "control"), (RELIABLE, "eos")):
        output = topic_name(NAME, client)
        cluster.create_topic(output, 3)
        group = f"lab-{NAME}-{client}-{uuid.uuid4().hex[:6]}"
        copier = CopierProcess(
            ["--mode", mode, "--bootstrap", bs, "--input", source, "--output", output, "--group", group,
             "--instance", "copier-0", "--delay-ms", "1.5", "--static-membership"],
            name=f"{client}-copier",
        )
        runs[client] = (output, group, copier)
    copiers = [copier for _, _, copier in runs.values()]

    def finished() -> bool:
        return all(group_lag(bs, group, source) == 0 for _, group, _ in runs.values())

    try:
        for copier in copiers:
            copier.start()
        for n, copier in enumerate(kill_rounds(copiers, rounds=KILLS, at_progress=0.2, finished=finished,
                                               deadline_s=40), start=1):
            progress(f"SIGKILLed the {copier.name} ({n} of {KILLS * len(copiers)})", 0.05 + 0.6 * n / 6)
        progress("letting the copiers finish", 0.7)
        deadline = time.monotonic() + 60
        while not finished() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        for copier in copiers:
            copier.stop()
    progress("reading the outputs back (read_committed)", 0.9)
    results = []
    for client, (output, _, copier) in runs.items():
        seen = [(m.value(), message_id_of(m.headers())) for m in consume_all(bs, output)]
        detail = f"{copier.kills} copier SIGKILLs at >=20% progress"
        if client == RELIABLE:
            everything = sum(1 for _ in consume_all(bs, output, isolation_level="read_uncommitted"))
            detail += f"; {everything - len(seen)} records of aborted transactions hidden from read_committed"
        results.append(result_from(NAME, client, values, seen, started, detail))
    return results


SCENARIO = Scenario(
    name=NAME,
    description="a Kafka-to-Kafka copier is SIGKILLed 3 times mid-copy: at-least-once copier vs "
    "TransactionalProcessor (seed 002)",
    run=run,
)


if __name__ == "__main__":
    sys.exit(copier_main())
