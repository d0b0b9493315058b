"""The outbox pool against the real cluster: workers that die with pending messages lose none of them.

Two workers of one `outbox_dir` accept messages while their brokers are unreachable and are SIGKILLed;
one new worker starts (the deployment shrank from two to one), takes one dead slot as its own and adopts
the other, and an independent reader finds every accepted message in the topic.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reliable_kafka.ids import message_id_of
from reliable_kafka.outbox.pool import pool_status
from reliable_kafka.testing import consume_all
from reliable_kafka.testing.verify import verdict
from tests.fixtures.members import MemberLogs

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PER_WORKER = 2_000

# A worker of the pool: sends argv[4] unique values "<tag>-<i>" to topic argv[3] through a producer on
# outbox_dir argv[2] with bootstrap argv[1], says "accepted" once send_many() returned, and runs until
# its stdin closes (or it is killed).
WORKER = """
    import sys
    from reliable_kafka.producer import ReliableProducer
    bootstrap, directory, topic, tag, count = sys.argv[1:6]
    p = ReliableProducer({"bootstrap.servers": bootstrap}, outbox_dir=directory, preflight="off")
    p.send_many([(topic, f"{tag}-{i}".encode()) for i in range(int(count))])
    print("accepted", flush=True)
    sys.stdin.read()
    left = p.close(timeout=30)
    print(f"closed {left}", flush=True)
"""


def start_worker(bootstrap: str, directory: Path, topic: str, tag: str, count: int,
                 logs: MemberLogs) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(logs.path(f"worker-{tag}"), "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(WORKER), bootstrap, str(directory), topic, tag, str(count)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)


def said(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()  # a dead worker gives "" at once; the module's timeout bounds it


def test_two_workers_killed_with_pending_rows_one_new_worker_delivers_all_of_them(kafka, make_topic, tmp_path,
                                                                                 member_logs) -> None:
    topic = make_topic(partitions=3)
    directory = tmp_path / "outbox-pool"
    workers: list[subprocess.Popen[str]] = []
    try:
        # 1. Two workers accept while their brokers are unreachable (a closed port): every row stays pending.
        for tag in ("a", "b"):
            workers.append(start_worker("127.0.0.1:1", directory, topic, tag, PER_WORKER, member_logs))
        for w in workers:
            assert said(w) == "accepted", f"worker {w.pid} did not accept (see its log)"
        accepted = [f"{tag}-{i}".encode() for tag in ("a", "b") for i in range(PER_WORKER)]
        before = {s.path.name: (s.owner_pid, s.pending) for s in pool_status(directory)}
        assert before == {"slot-0.db": (workers[0].pid, PER_WORKER), "slot-1.db": (workers[1].pid, PER_WORKER)} \
            or before == {"slot-0.db": (workers[1].pid, PER_WORKER), "slot-1.db": (workers[0].pid, PER_WORKER)}, \
            before

        # 2. Both die without a chance to deliver (only the pids started above are signalled).
        for w in workers:
            os.kill(w.pid, signal.SIGKILL)
        for w in workers:
            assert w.wait(10) == -signal.SIGKILL
        # Control: the fault bites. The dead workers' slots hold every accepted message, unlocked, and the
        # topic holds none of them: whatever the reader finds below came out of the pool.
        dead = {s.path.name: (s.locked, s.pending) for s in pool_status(directory)}
        assert dead == {"slot-0.db": (False, PER_WORKER), "slot-1.db": (False, PER_WORKER)}, dead
        assert list(consume_all(kafka.bootstrap_servers, topic)) == []

        # 3. The deployment shrank: one new worker starts on the same directory, with reachable brokers.
        survivor = start_worker(kafka.bootstrap_servers, directory, topic, "c", 100, member_logs)
        workers.append(survivor)
        assert said(survivor) == "accepted"
        accepted += [f"c-{i}".encode() for i in range(100)]
        deadline = time.monotonic() + 180
        while True:
            slots = pool_status(directory)
            if all(s.pending == 0 for s in slots) and not any(s.locked and s.owner_pid != survivor.pid
                                                               for s in slots):
                break
            assert time.monotonic() < deadline, f"the pool was not drained within 180s: {slots}"
            assert survivor.poll() is None, f"the new worker exited early (exit {survivor.returncode})"
            time.sleep(0.2)
        assert {s.path.name for s in slots} == {"slot-0.db", "slot-1.db"}, "one slot claimed, one adopted"
        assert survivor.stdin is not None
        survivor.stdin.close()
        assert said(survivor) == "closed 0"
        assert survivor.wait(60) == 0
        assert all(not s.locked for s in pool_status(directory)), "close() released its slot and the adopted one"
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(10)

    # 4. An independent reader: every accepted message is there, once after dedup by rk-id.
    msgs = list(consume_all(kafka.bootstrap_servers, topic))
    raw = verdict(accepted, [m.value() for m in msgs])
    assert raw.lost == 0, raw
    first_by_id: dict[str | None, bytes] = {}
    for m in msgs:
        first_by_id.setdefault(message_id_of(m.headers()), m.value())
    assert None not in first_by_id, "every message carries an rk-id"
    deduped = verdict(accepted, first_by_id.values())
    assert (deduped.acked, deduped.lost, deduped.duplicates) == (2 * PER_WORKER + 100, 0, 0), (deduped, raw)
