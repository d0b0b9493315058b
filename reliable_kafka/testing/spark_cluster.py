"""LocalSparkCluster: a real Spark standalone cluster (one Master, N Workers, one JVM each) on loopback.

Each Worker has a host of its own (127.0.0.2, 127.0.0.3, ...: every 127.x.y.z address is loopback on
Linux), so Spark treats them as different machines: speculation runs a task's copy on another Worker,
which it never does on the same host. Only pids it started (its Master and Workers, and the executor
JVMs those Workers started) are ever signalled; stop() ends them all, also when a test failed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reliable_kafka.errors import ClusterError
from reliable_kafka.testing.cluster import _die_with_parent, free_port

log = logging.getLogger(__name__)

_EXECUTOR_MAIN = b"org.apache.spark.executor.CoarseGrainedExecutorBackend"


def spark_home() -> Path:
    """The installed pyspark: its jars/ and bin/spark-class are a complete Spark distribution."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def package_zip(dest_dir: str | os.PathLike[str]) -> Path:
    """reliable_kafka as a zip for `spark.submit.pyFiles` (docs/spark.md "Running on a cluster"): the executors
    import the package from it, the compiled confluent-kafka and pyarrow from the interpreter every node has."""
    import reliable_kafka

    package = Path(reliable_kafka.__file__).resolve().parent
    return Path(shutil.make_archive(str(Path(dest_dir) / "reliable_kafka"), "zip", root_dir=package.parent,
                                    base_dir=package.name))


def driver_conf(master_url: str, py_files: str | os.PathLike[str], *, ui_port: int | None = None,
                jvm_options: Sequence[str] = (), tmpdir: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The settings of a driver process on this machine that runs its jobs on a LocalSparkCluster.

    The package ships as a zip (package_zip()); the driver binds loopback; the executors take 1 core and
    512 MB, so each Worker (1 core, 1 GB) holds one. `ui_port` turns the driver's UI on (its REST API says
    how each task attempt ended). `tmpdir` becomes java.io.tmpdir of the driver and of the executors: a
    SIGKILLed JVM runs no shutdown hook, and left its native libraries (liblz4-java-*.so) in /tmp.
    """
    java = list(jvm_options) + ([f"-Djava.io.tmpdir={tmpdir}"] if tmpdir is not None else [])
    conf = {
        "spark.master": master_url,
        "spark.submit.pyFiles": str(py_files),
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.driver.memory": "512m",
        "spark.executor.memory": "512m",
        "spark.executor.cores": "1",
        "spark.ui.enabled": "false" if ui_port is None else "true",
        "spark.ui.showConsoleProgress": "false",
    }
    if ui_port is not None:
        conf["spark.ui.port"] = str(ui_port)
    if java:
        conf["spark.driver.extraJavaOptions"] = conf["spark.executor.extraJavaOptions"] = " ".join(java)
    return conf


@dataclass
class SparkDaemon:
    """One Master or Worker JVM."""

    name: str
    host: str
    port: int
    ui_port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class LocalSparkCluster:
    """A Spark standalone Master on 127.0.0.1 and `workers` Workers on 127.0.0.2, 127.0.0.3, ...

    Use it as a context manager (or start()/stop()); `master_url` is what a driver connects to.
    Workers offer `worker_cores` cores and `worker_memory_mb` MB each; the daemons run with
    `daemon_heap_mb` of heap (they only schedule), the executors with what the application asks for.
    """

    workers: int = 2
    worker_cores: int = 1
    worker_memory_mb: int = 1024
    daemon_heap_mb: int = 256
    # Extra JVM flags for the Master and Workers, e.g. QUICK_START_JVM_OPTIONS.
    jvm_options: Sequence[str] = ()
    # Environment for the daemons (and so for the executors the Workers start), on top of os.environ.
    env: Mapping[str, str] = field(default_factory=dict)
    data_dir: str | os.PathLike[str] | None = None
    master: SparkDaemon | None = field(default=None, init=False)
    nodes: list[SparkDaemon] = field(default_factory=list, init=False)
    _owns_data_dir: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 250:
            raise ValueError(f"workers must be between 1 and 250 (one loopback address each), got {self.workers}")

    def __enter__(self) -> LocalSparkCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def master_url(self) -> str:
        assert self.master is not None, "start() the cluster first"
        return f"spark://{self.master.host}:{self.master.port}"

    @property
    def worker_hosts(self) -> list[str]:
        return [w.host for w in self.nodes]

    def start(self, timeout: float = 60.0) -> LocalSparkCluster:
        """Start the Master and every Worker at once; returns when the Master lists them all ALIVE."""
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise ClusterError("java is not on PATH: install a Java 17+ runtime (Spark needs it)")
        if self.data_dir is None:
            self.data_dir = tempfile.mkdtemp(prefix="rk-spark-")
            self._owns_data_dir = True
        root = Path(self.data_dir)
        self.master = SparkDaemon("master", "127.0.0.1", free_port(), free_port(), root / "master.log")
        self.nodes = [
            SparkDaemon(f"worker-{i}", f"127.0.0.{i + 2}", free_port(), free_port(), root / f"worker-{i}.log")
            for i in range(self.workers)
        ]
        try:
            # The Workers need not wait for the Master: they retry registering until it answers.
            self._launch(self.master, "org.apache.spark.deploy.master.Master",
                         "--host", self.master.host, "--port", str(self.master.port),
                         "--webui-port", str(self.master.ui_port))
            for worker in self.nodes:
                work_dir = root / worker.name
                work_dir.mkdir(parents=True, exist_ok=True)
                self._launch(worker, "org.apache.spark.deploy.worker.Worker",
                             "--host", worker.host, "--port", str(worker.port),
                             "--webui-port", str(worker.ui_port), "--cores", str(self.worker_cores),
                             "--memory", f"{self.worker_memory_mb}m", "--work-dir", str(work_dir),
                             self.master_url)
            self.wait_workers(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        log.info("Spark standalone cluster up: %s, workers on %s", self.master_url, ", ".join(self.worker_hosts))
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """SIGKILL every executor, Worker and the Master (their state is throw-away); remove a temporary dir."""
        for pid in self.executor_pids():
            self._kill_pid(pid)
        for daemon in [*self.nodes, *([self.master] if self.master else [])]:
            if daemon.alive():
                assert daemon.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    daemon.proc.send_signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.proc.wait(timeout)
        if self._owns_data_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    # ---- state -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The Master's own view (its web UI's /json): workers, applications, cores."""
        assert self.master is not None
        with urllib.request.urlopen(f"http://{self.master.host}:{self.master.ui_port}/json/", timeout=5) as rsp:
            return dict(json.loads(rsp.read()))

    def alive_workers(self) -> list[str]:
        """Hosts of the Workers the Master lists as ALIVE."""
        return sorted(w["host"] for w in self.state().get("workers", []) if w.get("state") == "ALIVE")

    def wait_workers(self, timeout: float = 60.0) -> None:
        """Until the Master lists every Worker as ALIVE; fails early, with its log, when a daemon died."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            dead = [d for d in [self.master, *self.nodes] if d is not None and not d.alive()]
            if dead:
                raise ClusterError(f"Spark {dead[0].name} exited during start-up; last log lines:\n"
                                   + self.logs(dead[0].name, 40))
            try:
                if self.alive_workers() == sorted(self.worker_hosts):
                    return
            except OSError as exc:  # the Master's UI is not listening yet
                last = exc
            except ValueError as exc:  # not JSON yet: on a loaded host the UI once answered an HTML page first
                last = exc
            time.sleep(0.2)
        raise ClusterError(f"Spark workers not all registered with {self.master_url} within {timeout:.0f}s"
                           + (f" (last error: {last})" if last else "") + "; master log:\n" + self.logs("master", 40))

    def logs(self, name: str, tail: int = 200) -> str:
        daemon = self.master if name == "master" else next((w for w in self.nodes if w.name == name), None)
        if daemon is None or not daemon.log_path.exists():
            return ""
        return "\n".join(daemon.log_path.read_text(errors="replace").splitlines()[-tail:])

    # ---- executors (started by the Workers, so known only as their children) -----------------

    def executor_pids(self) -> dict[int, str]:
        """{pid: worker host} of every live executor JVM of this cluster's Workers."""
        found: dict[int, str] = {}
        for worker in self.nodes:
            if not worker.alive():
                continue
            assert worker.proc is not None
            for child in _children(worker.proc.pid):
                if _EXECUTOR_MAIN in _cmdline(child):
                    found[child] = worker.host
        return found

    def kill_executor(self, pid: int) -> None:
        """SIGKILL one executor JVM and every process it started (a machine's crash); its Worker starts a new one.

        The JVM's descendants die with it: its pyspark daemon and Python workers. Killed alone, the JVM left
        them running for a moment, and a writer that already held the rest of its input finished and
        committed its partition after its executor was gone, so the kill met no write at all.
        """
        if pid not in self.executor_pids():
            raise ClusterError(f"pid {pid} is not an executor of this cluster (executors: {self.executor_pids()})")
        # Gathered before the kill: once the JVM is gone, its children belong to init.
        family = _descendants(pid)
        self._kill_pid(pid)
        for child in family:
            self._kill_pid(child)

    def _kill_pid(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _launch(self, daemon: SparkDaemon, main: str, *args: str) -> None:
        home = spark_home()
        env = {**os.environ, **self.env,
               "SPARK_HOME": str(home),
               # Each daemon binds its own loopback address (the Worker passes it on to its executors).
               "SPARK_LOCAL_IP": daemon.host,
               "SPARK_LOG_DIR": str(daemon.log_path.parent),
               "SPARK_DAEMON_MEMORY": f"{self.daemon_heap_mb}m",
               "SPARK_DAEMON_JAVA_OPTS": " ".join(self.jvm_options)}
        logfile = open(daemon.log_path, "ab")  # noqa: SIM115 - handed to the child; closed right after spawn
        try:
            # spark-class execs the JVM, so the pid we hold is the daemon's own.
            daemon.proc = subprocess.Popen(
                [str(home / "bin" / "spark-class"), main, *args],
                stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=daemon.log_path.parent,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - no JVM outlives a crashed test run
            )
        finally:
            logfile.close()


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, theirs, ...), nearest first."""
    found, todo = [], _children(pid)
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo += _children(child)
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
