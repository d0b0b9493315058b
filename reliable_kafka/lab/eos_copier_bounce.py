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

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.config import consumer_config, producer_config
from reliable_kafka.errors import TransactionFailed, TransactionFenced
from reliable_kafka.ids import ID_HEADER, message_id_of, new_ids
from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import read_back, result_from, topic_name
from reliable_kafka.testing.child_connection import Connection, child_env, connection_from_env, connection_of
from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.gates import Feeder, fire_when, wait_drained
from reliable_kafka.testing.offsets_probe import OffsetsProbe
from reliable_kafka.transactions import CommitInfo, MapValues, OutputRecord, TransactionalProcessor

log = logging.getLogger(__name__)

NAME = "eos-copier-bounce"
MESSAGES = 5_000
KILLS = 3
# The feeder tops the input up by TOP_UP records whenever a copier has fewer than LOW_WATER left, until
# the last kill: about 1.5 s of copying either way, so no copier runs dry between two looks.
TOP_UP = 1_000
LOW_WATER = 1_000
# Where the copier's code lives, so a child started from anywhere imports this same copy of it.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


# ---- the two copiers ---------------------------------------------------------------------------


class AtLeastOnceCopier:
    """The control, and the benchmark's baseline: a plain confluent-kafka copier, at-least-once.

    Records are copied (value, key, headers) with an idempotent acks=all producer; every
    `commit_interval_s` the producer is flushed and only then are the consumed offsets committed. A
    crash between the two copies again what was produced since the last commit: duplicates, no loss.
    `connection`: where the brokers are and how to log in, given to both clients.
    """

    def __init__(
        self,
        connection: Mapping[str, Any],
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
            {**connection, "group.id": group_id, **dict(consumer_overrides or {})}
        ))
        self._producer = Producer(producer_config(connection))
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
                # Inline first: this loop is also the eos benchmark's baseline, and one more call per
                # record would slow the baseline (see backpressure.produce_when_room).
                try:
                    producer.produce(output, msg.value(), msg.key(), headers=msg.headers())
                except BufferError:
                    produce_when_room(producer, output, msg.value(), msg.key(), headers=msg.headers())
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


def map_values_copy(output_topic: str, delay_s: float = 0.0) -> MapValues:
    """The same copy as a MapValues (the processor's own path for it): the value as it is, under the
    input's key, with the rk-id "<input rk-id>:0"."""

    def value(msg: Message) -> bytes | None:
        if delay_s:
            time.sleep(delay_s)
        return msg.value()

    return MapValues(output_topic, value)


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
        self.event("commit", copied=self._copied, progress=self._copied / total if total else 0.0,
                   partitions=sorted(p for _, p in self._latest))


def copier_main(argv: Sequence[str] | None = None) -> int:
    """The copier child: `python -m reliable_kafka.lab.eos_copier_bounce --mode eos|control ...`.

    Stops gracefully on SIGTERM (exit 0); exits 3 when fenced, 4 on another transactional failure. Its
    connection settings come in its environment (CopierProcess puts them there), or --bootstrap alone.
    """
    ap = argparse.ArgumentParser(description=copier_main.__doc__)
    ap.add_argument("--mode", choices=["eos", "control"], required=True)
    ap.add_argument("--bootstrap", help="the brokers of an open cluster (default: from the environment)")
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--instance", required=True, help="stable instance name: the transactional.id suffix")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="pause per record, to stretch the copy")
    ap.add_argument("--transform", choices=["copy", "map-values"], default="copy",
                    help="eos: an OutputRecord per record (copy) or a MapValues (map-values)")
    ap.add_argument("--static-membership", action="store_true",
                    help="use the instance name as group.instance.id: a restart rejoins without a rebalance")
    ap.add_argument("--session-timeout-ms", type=int, default=6_000)
    ap.add_argument("--transaction-timeout-ms", type=int, default=60_000)
    # The processor's own default lingers until the commit (nothing is visible before it anyway). The
    # kills are aimed at moments when the brokers hold records of an open transaction, which that makes
    # a few milliseconds per commit; the copier sends its records as they come instead.
    ap.add_argument("--linger-ms", type=float, default=5.0,
                    help="eos: the producer's linger.ms (default 5: records reach the brokers before the commit)")
    args = ap.parse_args(argv)
    # A stop that overruns its time gets SIGUSR1 before SIGKILL: every thread's stack goes to stderr,
    # so the log says where the copier was blocked.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {args.instance} %(levelname)s %(name)s: %(message)s")

    connection = connection_from_env(args.bootstrap)
    with OffsetsProbe(connection) as probe:
        reporter = _Reporter({(args.input, p): end for p, end in probe.end_offsets(args.input).items()})
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
            connection, group_id=args.group, input_topic=args.input,
            output_topic=args.output, delay_s=delay, consumer_overrides=consumer_overrides,
            on_commit=reporter.committed,
        )
    else:
        copier = TransactionalProcessor(
            {**connection, "group.id": args.group},
            input_topics=[args.input],
            transform=(copy_transform if args.transform == "copy" else map_values_copy)(args.output, delay),
            transactional_id=f"{args.group}-{args.instance}",
            consumer_overrides=consumer_overrides,
            producer_overrides={"transaction.timeout.ms": args.transaction_timeout_ms, "linger.ms": args.linger_ms},
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

    Its JSON events come on stdout. With `log_path`, its stderr and any other stdout line go to that file
    (appended, one file across restarts, with a line at each start, kill and stop), so a failed test can
    show what each copier said; without it, stderr is inherited. Only the pid this object started is
    ever signalled. `connection` (a secured cluster's login) reaches the child in its environment, never
    in `args`.
    """

    def __init__(self, args: Sequence[str], *, module: str = __name__, name: str = "copier",
                 log_path: str | os.PathLike[str] | None = None, connection: Connection | None = None) -> None:
        self.name = name
        self._connection = connection
        self.kills = 0
        self._argv = [sys.executable, "-m", module, *args]
        self._log_path = Path(log_path) if log_path is not None else None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._progress = 0.0
        self._partitions: frozenset[int] = frozenset()
        self._started = threading.Event()
        self._events: list[dict[str, Any]] = []
        self.stop_overran = False  # the last stop() had to SIGKILL: the graceful stop took too long

    def start(self) -> None:
        env = dict(os.environ) if self._connection is None else child_env(self._connection)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
        with self._lock:
            self._progress = 0.0
            self._partitions = frozenset()
            self._started.clear()
        if self._log_path is None:
            self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        else:
            self._note(f"starting: {' '.join(self._argv[1:])}")
            # The child writes its stderr straight into the file (appending), so nothing is lost when it dies.
            with self._log_path.open("a") as stderr:
                self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                              env=env)
        assert self._proc.stdout is not None
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True,
                         name=f"{self.name}-stdout").start()

    def _note(self, line: str) -> None:
        """Append a line to the member log (if any): the driver's side of the story, or a stray stdout line."""
        if self._log_path is not None:
            with self._log_path.open("a") as out:
                out.write(line if line.endswith("\n") else line + "\n")

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                self._note(line)  # print()s and faulthandler output of the child, kept with its stderr
                continue
            with self._lock:
                self._events.append(event)
                if event.get("event") == "commit":
                    self._progress = float(event["progress"])
                    self._partitions = frozenset(event.get("partitions", ()))
            if event.get("event") == "started":
                self._started.set()
            elif event.get("event") in ("fenced", "failed", "stopped"):
                self._note(f"event: {line.strip()}")

    @property
    def progress(self) -> float:
        """How far the current incarnation got through the input left when it started (0..1)."""
        with self._lock:
            return self._progress

    @property
    def partitions(self) -> frozenset[int]:
        """Input partitions the current incarnation has committed offsets for (empty before its first commit)."""
        with self._lock:
            return self._partitions

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
            self._note(f"SIGKILLed by the driver (kill {self.kills}) at progress {self.progress:.2f}")

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
        self._note(f"stopped: exit code {proc.returncode}")
        return proc.returncode


def kill_rounds(
    copiers: Sequence[CopierProcess],
    *,
    rounds: int,
    at_progress: float,
    aim: Callable[[CopierProcess], bool],
    rearm: Callable[[], None] | None = None,
    attempts: int = 3,
    timeout_s: float = 60.0,
) -> Iterator[CopierProcess]:
    """Kafka's TransactionsTest bounce: each round, SIGKILL each copier in turn and restart it. Yields
    each copier right after its restart.

    Every kill is gated, never timed: it fires the moment the copier is alive, its current incarnation
    has made `at_progress` progress (reported at its commits) and `aim(copier)` holds, e.g. "its input
    has lag left and the output holds records of an open transaction". When that does not come within
    `timeout_s`, `rearm()` (top up the input) runs and the wait starts again, at most `attempts` times,
    each logged; then FaultNotArmed: a kill that could not land mid-copy is never fired blind.
    """
    for round_no in range(1, rounds + 1):
        for copier in copiers:
            def ready(c: CopierProcess = copier) -> bool:
                # The cheap local checks first; aim() asks the brokers.
                return c.alive() and c.progress >= at_progress and aim(c)

            fire_when(ready, copier.restart, what=f"SIGKILL of {copier.name} in round {round_no}", rearm=rearm,
                      attempts=attempts, timeout_s=timeout_s)
            yield copier


def seed_input(cluster: str | Connection, topic: str, n: int, *, start: int = 0, keys: int = 50) -> list[bytes]:
    """Append n unique values "k<key>:<seq>" keyed by k<key>, each with its own rk-id, to `topic`.

    Values number on from `start`, so topping up the input keeps every key's sequence increasing.
    """
    values = [f"k{i % keys:03d}:{i // keys:06d}".encode() for i in range(start, start + n)]
    producer = Producer(producer_config({**connection_of(cluster), "linger.ms": 20}))
    for value, mid in zip(values, new_ids(n), strict=True):
        produce_when_room(producer, topic, value, value.split(b":")[0], headers=[(ID_HEADER, mid.encode())])
    if producer.flush(60):
        raise RuntimeError(f"seeding {topic} did not finish")
    return values


class FedSource:
    """The copy's input topic and every value fed into it so far, in chunks numbered on by seed_input.

    Feeding is serialized, so each key's values reach the topic in increasing order however many
    threads feed (a Feeder, and fire_when re-arming); `values` is a snapshot of all that was fed.
    """

    def __init__(self, cluster: str | Connection, topic: str) -> None:
        self.cluster, self.topic = cluster, topic
        self._values: list[bytes] = []
        self._feeding = threading.Lock()  # one chunk at a time: numbering and offsets in the same order
        self._lock = threading.Lock()  # the list itself: a snapshot does not wait for a chunk to be sent

    def feed(self, n: int) -> None:
        with self._feeding:
            chunk = seed_input(self.cluster, self.topic, n, start=len(self._values))
            with self._lock:
                self._values += chunk

    @property
    def values(self) -> list[bytes]:
        with self._lock:
            return list(self._values)


# ---- the scenario ------------------------------------------------------------------------------


def run(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    conn = cluster.client_config()
    started = time.monotonic()
    source = FedSource(conn, topic_name(NAME, "input"))
    cluster.create_topic(source.topic, 2)
    progress("seeding the input", 0.02)
    source.feed(MESSAGES)
    runs: dict[str, tuple[str, str, CopierProcess]] = {}
    for client, mode in ((CONTROL, "control"), (RELIABLE, "eos")):
        output = topic_name(NAME, client)
        cluster.create_topic(output, 3)
        group = f"lab-{NAME}-{client}-{uuid.uuid4().hex[:6]}"
        copier = CopierProcess(
            ["--mode", mode, "--input", source.topic, "--output", output, "--group", group,
             "--instance", "copier-0", "--delay-ms", "1.5", "--static-membership"],
            name=f"{client}-copier", connection=conn,
        )
        runs[client] = (output, group, copier)
    copiers = [copier for _, _, copier in runs.values()]
    of_copier = {copier: (client, output, group) for client, (output, group, copier) in runs.items()}

    # One probe for every look at the group lags and the output: a gate asks many times a second, and a
    # new client per look (start-up, login, coordinator lookup) made it slow to see its moment.
    with OffsetsProbe(conn) as offsets:
        def unfinished() -> int:
            return sum(offsets.group_lag(group, source.topic) for _, group, _ in runs.values())

        def mid_copy(copier: CopierProcess) -> bool:
            # A kill proves something only while the copier has work left; the exactly-once copier's kill is
            # aimed at a moment when its output holds records of its open transaction (it is the only writer).
            client, output, group = of_copier[copier]
            if offsets.group_lag(group, source.topic) == 0:
                return False
            return client != RELIABLE or offsets.uncommitted_records(output) > 0

        # Both copiers read the same input: the one furthest ahead decides when to top it up. The copy cannot
        # finish before the last kill, however fast or slow this machine is.
        feeder = Feeder(lambda: source.feed(TOP_UP),
                        lambda: min(offsets.group_lag(group, source.topic) for _, group, _ in runs.values()),
                        low=LOW_WATER, poll_s=0.3, max_top_ups=100, max_seconds=300, name=f"{NAME}-feeder")
        try:
            for copier in copiers:
                copier.start()
            feeder.start()
            try:
                for n, copier in enumerate(kill_rounds(copiers, rounds=KILLS, at_progress=0.2, aim=mid_copy,
                                                       rearm=feeder.top_up_now, attempts=5, timeout_s=30), start=1):
                    progress(f"SIGKILLed the {copier.name} mid-copy ({n} of {KILLS * len(copiers)})",
                             0.05 + 0.6 * n / (KILLS * len(copiers)))
            finally:
                feeder.stop()  # what was fed is final: the verdict counts every value of it
            progress(f"letting the copiers finish ({len(source.values)} records fed)", 0.7)
            # Waited for while the copiers make progress (a copier that restarted last may rejoin slowly on
            # a loaded machine), so what they have not copied yet is not counted as lost by the verdict.
            left = wait_drained(unfinished, stall_s=60, timeout_s=600)
            if left:
                log.warning("the copiers stopped making progress with %d records left; counting what they wrote", left)
        finally:
            for copier in copiers:
                copier.stop()
        progress("reading the outputs back (read_committed)", 0.9)
        values = source.values
        results = []
        for client, (output, group, copier) in runs.items():
            seen = [(m.value(), message_id_of(m.headers())) for m in read_back(conn, output)]
            detail = f"{copier.kills} copier SIGKILLs mid-copy (each at >=20% progress, input left) of {len(values)} " \
                     f"records fed"
            if left:  # said in the verdict, so a stalled copier's backlog is not read as records it lost
                stalled = offsets.group_lag(group, source.topic)
                detail += f"; the copier stalled with {stalled} input records uncommitted"
            if client == RELIABLE:
                everything = len(read_back(conn, output, isolation_level="read_uncommitted"))
                detail += f"; {everything - len(seen)} records of aborted transactions hidden from read_committed"
            results.append(result_from(NAME, client, values, seen, started, detail))
        return results


SCENARIO = Scenario(
    name=NAME,
    description="L8 copier crash: a Kafka-to-Kafka copier is SIGKILLed 3 times mid-copy: at-least-once copier "
    "vs TransactionalProcessor",
    run=run,
)


if __name__ == "__main__":
    sys.exit(copier_main())
