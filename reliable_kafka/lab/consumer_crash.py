"""Lab scenario `consumer-crash` (seed 001, failure mode L6): the consuming process dies mid-batch.

The auto-commit control has already committed records it never handled, so they are skipped for
good; ReliableConsumer commits only handled records, so a crash redelivers instead of skipping.
Each kill is gated on the member's progress (see `kill_loop`), never on a sleep.
"""

from __future__ import annotations

import random
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from confluent_kafka import Producer

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import Connection, ledger_entries, result_from, run_program, topic_name
from reliable_kafka.lab.programs.status import GroupOffsets, MemberStatus
from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.gates import fire_when

KILLS = 5
MESSAGES = 20_000
PARTITIONS = 3
# The control's kill waits until its group has committed at least this many offsets it has not handled:
# more than the status file can lag behind (50 ms of handling), so the kill really skips records.
CONTROL_SKIP_MARGIN = 100

Bite = Callable[[MemberStatus, Mapping[int, int]], bool]
BITES: dict[str, Bite] = {
    # Ours: handled records not committed yet; the kill makes them be redelivered (never skipped).
    "reliable": lambda status, committed: status.uncommitted(committed) > 0,
    # The control: auto-commit ran ahead of the handler; the kill makes the group skip those records.
    "control": lambda status, committed: status.committed_unhandled(committed) >= CONTROL_SKIP_MARGIN,
}


def kill_loop(
    spawn: Callable[[bool], subprocess.Popen[bytes]],
    *,
    what: str,
    bite: Bite,
    status_file: Path,
    offsets: GroupOffsets,
    kills: int,
    rng: random.Random,
    min_handled: tuple[int, int],
    top_up: Callable[[], None],
    before_final: Callable[[], None] | None = None,
    final_timeout_s: float = 200.0,
) -> tuple[int, int]:
    """SIGKILL a consumer program `kills` times, each time mid-work, then let it run until it stops by itself.

    A kill fires once the member (started by `spawn(final)` with `--status-file status_file`; `final` is
    True for the last run, which must stop by itself, the others are killed) has handled a
    random number in `min_handled` of records since its start and `bite` (see BITES) holds against the
    group's committed offsets; a member killed before its first fetch, or idle, would prove nothing.
    If that does not come within 60 s, `top_up()` adds input and the wait starts again (at most 3
    times, logged, then FaultNotArmed). `before_final` runs before the last start (e.g. wait for the
    producer to finish). Returns (kills, exit code of the final run).
    """
    done = 0
    while done < kills:
        status_file.unlink(missing_ok=True)  # the last life's figures must not arm this one's kill
        child = spawn(False)
        wanted = rng.randint(*min_handled)

        def ready(child: subprocess.Popen[bytes] = child, wanted: int = wanted, life: int = done + 1) -> bool:
            if child.poll() is not None:
                raise AssertionError(f"{what} exited ({child.returncode}) before kill {life}")
            status = MemberStatus.read(status_file)
            return status is not None and status.handled >= wanted and bite(status, offsets.get())

        def kill(child: subprocess.Popen[bytes] = child) -> None:
            child.kill()  # SIGKILL, only our own child: no commit, no goodbye
            child.wait()

        try:
            fire_when(ready, kill, what=f"{what}: kill {done + 1}/{kills} (after {wanted} records)",
                      rearm=top_up, attempts=3, timeout_s=60)
        finally:
            if child.poll() is None:  # the gate failed: do not leave the member running
                child.kill()
                child.wait()
        done += 1
    if before_final is not None:
        before_final()
    child = spawn(True)
    try:
        return done, child.wait(timeout=final_timeout_s)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def _fill(connection: Connection, topic: str, n: int, prefix: str = "v") -> list[bytes]:
    from reliable_kafka.ids import ID_HEADER, new_ids

    values = [f"{prefix}-{i}".encode() for i in range(n)]
    p = Producer({**connection, "acks": "all", "enable.idempotence": True, "linger.ms": 10})
    for v, mid in zip(values, new_ids(n), strict=True):
        produce_when_room(p, topic, v, headers=[(ID_HEADER, mid.encode())])
    p.flush(60)
    return values


def _run_client(cluster: LocalKafkaCluster, progress: Progress, client: str, rng: random.Random) -> ScenarioResult:
    name = "consumer-crash"
    conn = cluster.client_config()
    started = time.monotonic()
    topic = topic_name(name, client)
    cluster.create_topic(topic, PARTITIONS, 3)
    values = _fill(conn, topic, MESSAGES)
    group = f"lab-{uuid.uuid4().hex[:8]}"
    mode = "reliable" if client == RELIABLE else "control"
    with tempfile.TemporaryDirectory() as d, GroupOffsets(conn, group, topic, PARTITIONS) as offsets:
        ledger, status_file = Path(d) / "ledger", Path(d) / "status.json"
        lives = [0]

        def spawn(final: bool) -> subprocess.Popen[bytes]:
            kills = min(lives[0], KILLS)
            progress(f"{client}: kill {kills}/{KILLS}", (0.5 if client == RELIABLE else 0) + kills / 12)
            lives[0] += 1
            return run_program("reliable_kafka.lab.programs.consumer_proc", [
                "--mode", mode, "--topic", topic, "--group", group, "--ledger", str(ledger),
                "--sleep-ms", "0.5", "--instance-id", "lab-member", "--idle", "5", "--status-file", str(status_file)],
                conn)

        def top_up() -> None:  # only if a kill's condition did not come: the member ran out of input
            values.extend(_fill(conn, topic, 2_000, prefix=f"v{len(values)}"))

        kills, _ = kill_loop(spawn, what=f"the {mode} member", bite=BITES[mode], status_file=status_file,
                             offsets=offsets, kills=KILLS, rng=rng, min_handled=(200, 2_000), top_up=top_up,
                             final_timeout_s=180)
        seen = ledger_entries(ledger)
    return result_from(name, client, values, seen, started, f"{kills} SIGKILLs; slow handler")


def run(cluster: LocalKafkaCluster, progress: Progress) -> list[ScenarioResult]:
    rng = random.Random(9)
    return [_run_client(cluster, progress, client, rng) for client in (CONTROL, RELIABLE)]


SCENARIO = Scenario("consumer-crash", "L6 consumer crash: the consuming process is SIGKILLed 5 times mid-batch", run)
