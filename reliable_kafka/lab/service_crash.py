"""Lab scenario `service-crash` (failure mode L4 in a web service): uvicorn workers SIGKILLed under HTTP load.

A load generator records every request that got a 200; the service's workers are SIGKILLed mid-load, and
once the whole server is killed and started again with one worker fewer, orphaning an outbox slot. Each
fault is gated on progress (enough newly acknowledged requests, a worker holding unconfirmed messages),
never on a sleep. The AIOProducer control loses what it had buffered; reliable_kafka loses nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliable_kafka.lab.base import CONTROL, RELIABLE, Progress, Scenario, ScenarioResult
from reliable_kafka.lab.common import Connection, count, topic_name
from reliable_kafka.outbox.pool import pool_status
from reliable_kafka.testing.child_connection import child_env, connection_of
from reliable_kafka.testing.cluster import LocalKafkaCluster
from reliable_kafka.testing.gates import fire_when, wait_for

log = logging.getLogger(__name__)

WORKERS = 3
# "worker": one worker SIGKILLed (uvicorn's master starts another); "restart": the master and all its
# workers SIGKILLed, and the server started again with one worker fewer (a slot of the pool is orphaned).
FAULTS: tuple[str, ...] = ("worker", "worker", "restart", "worker", "worker")
BETWEEN = (300, 600)  # requests acknowledged (HTTP 200) since the last fault before the next one fires
CONCURRENCY = 24  # requests in flight at once
# What the victim must hold unconfirmed by its last status (up to 50 ms old): the control's kill then loses
# acknowledged requests however many were confirmed since; ours must hold at least one pending message.
MARGIN = {CONTROL: 20, RELIABLE: 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parent_of(pid: int) -> int | None:
    """The parent pid of a live process (Linux /proc), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])  # fields after "(comm)": state, ppid, ...


@dataclass(frozen=True)
class Worker:
    pid: int
    unconfirmed: int


class Service:
    """The uvicorn server under test: a master we start in its own process group, and its workers.

    Only processes of that group are signalled: a worker only while its parent is our current master,
    the whole group when the server is killed. `cluster` (the connection settings, or an open cluster's
    bootstrap servers) reaches the workers in their environment, never on their command line.
    """

    def __init__(self, mode: str, cluster: str | Connection, topic: str, workdir: Path,
                 log_path: Path | None) -> None:
        self.mode = mode
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.status_dir = workdir / "status"
        self.status_dir.mkdir()
        self.outbox_dir = workdir / "outbox"
        self._env = {**child_env(connection_of(cluster)), "RK_LAB_MODE": mode, "RK_LAB_TOPIC": topic,
                     "RK_LAB_STATUS_DIR": str(self.status_dir), "RK_LAB_OUTBOX_DIR": str(self.outbox_dir)}
        self._log_path = log_path
        self.master: subprocess.Popen[bytes] | None = None

    def start(self, workers: int) -> None:
        with open(self._log_path or os.devnull, "ab") as out:
            self.master = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "reliable_kafka.lab.programs.service_proc:app", "--host",
                 "127.0.0.1", "--port", str(self.port), "--workers", str(workers), "--log-level", "warning",
                 "--no-access-log"],
                env=self._env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True)  # its own process group: the server's kill reaches its workers, nothing else
        log.info("service on %s: master %d, %d workers", self.url, self.master.pid, workers)

    def workers(self) -> list[Worker]:
        """The serving workers of the current master, from their status files."""
        if self.master is None:
            return []
        out = []
        for path in self.status_dir.glob("worker-*.json"):
            try:
                status = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # gone since the glob
            if parent_of(status["pid"]) == self.master.pid:
                out.append(Worker(status["pid"], status["unconfirmed"]))
        return out

    def serving(self) -> bool:
        """Whether the current master is still running (it exits at once when it cannot bind its port)."""
        return self.master is not None and self.master.poll() is None

    def master_exit_code(self) -> int | None:
        return None if self.master is None else self.master.poll()

    def wait_serving(self, workers: int, timeout_s: float = 60.0) -> None:
        if not wait_for(lambda: len(self.workers()) == workers, timeout_s=timeout_s, poll_s=0.1):
            raise RuntimeError(f"{workers} uvicorn workers did not start serving on {self.url} within {timeout_s:.0f}s")

    def kill_worker(self, pid: int) -> None:
        if self.master is None or parent_of(pid) != self.master.pid:
            raise RuntimeError(f"process {pid} is not a worker of our uvicorn master: not signalled")
        os.kill(pid, signal.SIGKILL)  # no shutdown, no flush; the master starts another worker
        (self.status_dir / f"worker-{pid}.json").unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL the master and every worker at once (their process group), and forget their status.

        Returns once the port is free again: start() binds the same port, and a SIGKILLed worker keeps
        the listening socket until it has really exited, which on a loaded host (a worker inside an
        fsync, say) came after the master's exit: the new master then failed with "Address already in
        use", served nothing, and the next fault's condition never held.
        """
        if self.master is not None and self.master.poll() is None:
            os.killpg(self.master.pid, signal.SIGKILL)
            self.master.wait()
        for path in self.status_dir.glob("worker-*.json"):
            path.unlink()
        if not wait_for(lambda: _port_free(self.port), timeout_s=30, poll_s=0.05):
            raise RuntimeError(f"port {self.port} is still in use 30s after the service's SIGKILL")

    def stop(self, timeout_s: float = 90.0) -> bool:
        """Shut down gracefully (SIGTERM: each worker closes its producer); SIGKILL after `timeout_s`.
        True if it stopped by itself."""
        if self.master is None or self.master.poll() is not None:
            return True
        self.master.terminate()
        try:
            self.master.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("service master %d did not stop within %.0fs; killing it", self.master.pid, timeout_s)
            self.kill()
            return False
        return True  # uvicorn's master joins its workers before it exits: none outlives it


def _port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now (as uvicorn binds: with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class LoadGenerator:
    """Requests with fresh ids from `concurrency` tasks; `acked` holds the ids that got HTTP 200, in order.

    A new connection per request (no keep-alive), so uvicorn's workers share the load and a restarted
    worker gets its part at once. A request that failed (its worker was killed, the server is down) is
    not retried: the client was told nothing, and its id is not counted as acknowledged.
    """

    def __init__(self, url: str, prefix: str, concurrency: int) -> None:
        self.url, self.prefix, self.concurrency = url, prefix, concurrency
        self.acked: list[bytes] = []
        self.failed = 0
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="load-generator", daemon=True)

    def start(self) -> LoadGenerator:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the load generator did not stop within {timeout_s:.0f}s")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    async def _main(self) -> None:
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request in the run log
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=30.0) as client:
            await asyncio.gather(*(self._requests(client) for _ in range(self.concurrency)))

    async def _requests(self, client: Any) -> None:
        import httpx

        while not self._stop.is_set():
            rid = f"{self.prefix}-{next(self._ids)}"
            try:
                response = await client.post("/send", params={"id": rid})
            except httpx.HTTPError:
                response = None
            if response is not None and response.status_code == 200:
                self.acked.append(rid.encode())
            else:
                self.failed += 1
                await asyncio.sleep(0.1)  # the server is down or restarting: do not spin


@dataclass
class FaultLog:
    """What `inject` did: worker SIGKILLs, what their victims held, and notes for the result's detail."""

    kills: int = 0
    held: int = 0
    notes: list[str] = field(default_factory=list)


def inject(service: Service, load: LoadGenerator, *, faults: Sequence[str], between: tuple[int, int], margin: int,
           rng: random.Random, what: str) -> FaultLog:
    """Run `faults` against the serving `service` while `load` runs; returns once the service answered
    `between[0]` more requests after the last one.

    Each fault fires once a random `between` more requests got a 200 since the last one and a worker's
    status shows at least `margin` unconfirmed messages; that worker is the victim ("worker"), or the
    whole server is killed and started again with one worker fewer ("restart"). Bounded: three waits of
    60 s per fault, then FaultNotArmed.
    """
    done = FaultLog()
    serving = len(service.workers())
    for n, fault in enumerate(faults, 1):
        mark, wanted = len(load.acked), rng.randint(*between)
        chosen: list[Worker] = []

        def ready(mark: int = mark, wanted: int = wanted, chosen: list[Worker] = chosen) -> bool:
            if not load.running:
                raise RuntimeError("the load generator stopped")
            if not service.serving():
                raise RuntimeError(f"the uvicorn master exited (code {service.master_exit_code()}): "
                                   "see the service log")
            if len(load.acked) - mark < wanted:
                return False
            holding = [w for w in service.workers() if w.unconfirmed >= margin]
            chosen[:] = sorted(holding, key=lambda w: w.unconfirmed)[-1:]
            return bool(chosen)

        def fire(fault: str = fault, chosen: list[Worker] = chosen) -> int:
            if fault == "worker":
                service.kill_worker(chosen[0].pid)
            else:
                service.kill()
            return chosen[0].unconfirmed

        held = fire_when(ready, fire, what=f"{what}: {fault} SIGKILL {n}", rearm=lambda: None, timeout_s=60,
                         poll_s=0.01)
        log.info("%s: %s SIGKILL %d; the victim held %d unconfirmed", what, fault, n, held)
        done.held += held
        if fault == "worker":
            done.kills += 1
        else:
            serving = max(1, serving - 1)
            pool = ""
            if service.mode == "reliable":
                pool = f" with {_pool_pending(service.outbox_dir)} pending in the outbox pool"
            service.start(serving)
            done.notes.append(f"server SIGKILLed{pool}, restarted with {serving} worker(s)")
    # The load goes on until the service answered again after the last fault.
    mark = len(load.acked)
    if not wait_for(lambda: len(load.acked) - mark >= between[0], timeout_s=60, poll_s=0.05):
        raise RuntimeError(f"{what}: the service answered no requests after its last fault")
    return done


def _faulted_run(cluster: LocalKafkaCluster, name: str, client: str, rng: random.Random, *, faults: Sequence[str],
                 between: tuple[int, int], workers: int, log_path: Path | None) -> ScenarioResult:
    conn = cluster.client_config()
    started = time.monotonic()
    topic = topic_name(name, client)
    cluster.create_topic(topic, 3, 3, {"min.insync.replicas": 2})
    mode = "reliable" if client == RELIABLE else "control"
    with tempfile.TemporaryDirectory() as d:
        service = Service(mode, conn, topic, Path(d), log_path)
        load = LoadGenerator(service.url, client[0], CONCURRENCY)
        try:
            service.start(workers)
            service.wait_serving(workers)
            load.start()
            done = inject(service, load, faults=faults, between=between, margin=MARGIN[client], rng=rng,
                          what=f"{name} ({client})")
            load.stop()
            if not service.stop():
                done.notes.append("the graceful shutdown timed out")
        finally:
            if load.running:
                load.stop()
            service.kill()
        if client == RELIABLE:
            done.notes += _drain_leftovers(conn, service.outbox_dir)
    detail = "; ".join([f"{done.kills} worker SIGKILLs (victims held {done.held} unconfirmed)", *done.notes,
                        f"{load.failed} requests without a 200"])
    return count(name, client, load.acked, conn, topic, started, detail)


def _pool_pending(outbox_dir: Path) -> int:
    return sum(s.pending or 0 for s in pool_status(outbox_dir)) if outbox_dir.is_dir() else 0


def _drain_leftovers(connection: Connection, outbox_dir: Path) -> list[str]:
    """What the service's own shutdown did not deliver (e.g. a slot adopted when the shutdown came) is
    delivered by a new producer of the pool, as the next deployment would; said in the detail."""
    from reliable_kafka.producer import ReliableProducer

    left = _pool_pending(outbox_dir)
    if not left:
        return []
    with ReliableProducer(dict(connection), outbox_dir=outbox_dir):
        drained = wait_for(lambda: _pool_pending(outbox_dir) == 0, timeout_s=120, poll_s=0.5)
    return [f"{left} left pending at shutdown, delivered by a new producer of the pool"
            + ("" if drained else " (not all within 120s)")]


def service_crash(cluster: LocalKafkaCluster, progress: Progress, *, faults: Sequence[str] = FAULTS,
                  between: tuple[int, int] = BETWEEN, workers: int = WORKERS,
                  log_path: Path | None = None) -> list[ScenarioResult]:
    """Uvicorn workers SIGKILLed under HTTP load, and the server restarted once with a worker fewer."""
    name = "service-crash"
    rng = random.Random(7)
    out = []
    for client in (CONTROL, RELIABLE):
        progress(f"{client}: {len(faults)} SIGKILLs under HTTP load", 0.5 if client == RELIABLE else 0)
        out.append(_faulted_run(cluster, name, client, rng, faults=faults, between=between, workers=workers,
                                log_path=log_path))
    return out


SCENARIO = Scenario(
    "service-crash",
    "L4 in a web service: uvicorn workers SIGKILLed under HTTP load, restarted once with a worker fewer",
    service_crash, needs=("services",))
