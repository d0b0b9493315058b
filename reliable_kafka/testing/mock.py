"""MockCluster: a librdkafka mock Kafka cluster in a child process, for testing client error paths.

It injects request errors, leader moves, broker outages, coordinator moves and slow responses; it is
not Kafka, so nothing shown against it counts as evidence of a delivery or exactly-once guarantee.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from reliable_kafka.errors import ClusterError
from reliable_kafka.testing.mock_server import ALL_BROKERS, COORDINATOR_KEY_TYPES, api_key, error_codes

log = logging.getLogger(__name__)

# The directory that holds the reliable_kafka package, so the child imports this same copy of it.
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_STDERR_TAIL_BYTES = 4_000


class MockCluster:
    """A librdkafka mock Kafka cluster running in its own process, for client error-path tests.

    Use it to make a client meet the errors it must survive: request errors pushed per ApiKey
    (``push_request_errors``), leader moves (``set_leader``), brokers that stop accepting connections
    (``broker_down``/``broker_up``), coordinator moves (``set_coordinator``) and slow responses
    (``set_rtt``). Brokers have ids 1..brokers; ``ALL_BROKERS`` (-1) means every broker where noted.

    What it is NOT: the mock does not enforce ``read_committed`` (consumers may see records of open or
    aborted transactions), does not store offsets sent with TxnOffsetCommit
    (``send_offsets_to_transaction``), and does not check sequence numbers for non-transactional
    idempotent producers (a duplicate or reordered batch is accepted). Never use it to claim that a
    message was delivered exactly once, or at all — that needs a real cluster (``LocalKafkaCluster``).

    The cluster runs in a child process (``python -m reliable_kafka.testing.mock_server``), so a client
    process under test can be SIGKILLed while the cluster lives on. The child exits when its stdin
    closes, hence also when this process dies. Commands are serialised, so one instance may be shared
    by threads. Every failure raises ``ClusterError``: the child died, did not answer in time (it is
    then terminated), or refused the command (the message says why); arguments that can never be
    valid (unknown request name, empty error list) raise ``ValueError`` before anything is sent.

    Example::

        with MockCluster(brokers=3) as cluster:
            cluster.create_topic("orders", partitions=1)
            cluster.push_request_errors("Produce", [KafkaError.NOT_ENOUGH_REPLICAS] * 3)
            producer = Producer({"bootstrap.servers": cluster.bootstrap_servers, ...})
    """

    #: Pass as ``broker_id`` to ``broker_down``/``broker_up``/``set_rtt`` to act on every broker.
    ALL_BROKERS = ALL_BROKERS

    def __init__(
        self, brokers: int = 3, *, start_timeout: float = 60.0, command_timeout: float = 10.0
    ) -> None:
        """Describe the cluster; nothing runs until ``start()`` (or ``with``).

        ``start_timeout`` bounds the child's start-up, ``command_timeout`` each command's answer. The
        start-up bound is generous on purpose: a new Python child importing confluent-kafka took over 15 s
        on a 2-core host that also ran brokers and a Spark job, and a bound that a loaded host can miss
        is a flaky test, not a check.
        """
        if brokers < 1:
            raise ValueError(f"brokers must be at least 1, got {brokers}")
        self.brokers = brokers
        self.start_timeout = start_timeout
        self.command_timeout = command_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None
        self._buffer = b""
        self._bootstrap_servers: str | None = None
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> MockCluster:
        """Start the child process and wait for its bootstrap servers; returns self."""
        with self._lock:
            if self._proc is not None:
                raise ClusterError(f"mock cluster already running (pid {self._proc.pid})")
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
            # A file, not a pipe: nobody reads stderr while the cluster runs, and a full pipe would block it.
            # It lives as long as the child, so no `with`; _shutdown() closes it.
            self._stderr = tempfile.TemporaryFile(prefix="reliable-kafka-mock-", suffix=".log")  # noqa: SIM115
            self._buffer = b""
            argv = [
                sys.executable,
                "-m",
                "reliable_kafka.testing.mock_server",
                "--brokers",
                str(self.brokers),
            ]
            try:
                self._proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=self._stderr,
                    env=env,
                    close_fds=True,
                )
            except OSError as exc:
                self._shutdown()
                raise ClusterError(f"cannot start the mock cluster process {argv}: {exc}") from exc
            try:
                hello = self._read_reply("start-up", self.start_timeout)
                bootstrap = hello.get("bootstrap_servers")
                if not isinstance(bootstrap, str) or not bootstrap:
                    raise ClusterError(f"mock cluster sent no bootstrap_servers at start-up: {hello!r}")
            except ClusterError:
                self._shutdown()
                raise
            self._bootstrap_servers = bootstrap
            log.info("mock cluster of %d brokers at %s (pid %d)", self.brokers, bootstrap, self._proc.pid)
            return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the cluster: close the child's stdin, wait, and only then terminate the child. Idempotent."""
        with self._lock:
            self._shutdown(timeout)

    def __enter__(self) -> MockCluster:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def bootstrap_servers(self) -> str:
        """``host:port,...`` of the mock brokers, for a client's ``bootstrap.servers``."""
        if self._bootstrap_servers is None or self._proc is None:
            raise ClusterError("mock cluster is not running: call start() or use it as a context manager")
        return self._bootstrap_servers

    @property
    def pid(self) -> int | None:
        """The child process's id while it runs, else None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def broker_ids(self) -> list[int]:
        """The mock brokers' ids, 1..brokers."""
        return list(range(1, self.brokers + 1))

    # -- fault injection ---------------------------------------------------------------------------

    def create_topic(self, name: str, partitions: int = 1, replication_factor: int = 3) -> None:
        """Create a topic (the mock also auto-creates topics a client asks for, with its own defaults)."""
        self._command(
            {
                "cmd": "create_topic",
                "topic": name,
                "partitions": partitions,
                "replication_factor": replication_factor,
            }
        )

    def broker_down(self, broker_id: int) -> None:
        """Disconnect a broker (-1: all) and refuse new connections; its partitions keep their leader."""
        self._command({"cmd": "broker_down", "broker_id": broker_id})

    def broker_up(self, broker_id: int) -> None:
        """Let a broker (-1: all) accept connections again."""
        self._command({"cmd": "broker_up", "broker_id": broker_id})

    def set_leader(self, topic: str, partition: int, broker_id: int) -> None:
        """Move a partition's leader to ``broker_id`` (-1: leaderless); clients learn it from Metadata."""
        self._command({"cmd": "set_leader", "topic": topic, "partition": partition, "broker_id": broker_id})

    def push_request_errors(self, api: str | int, errors: Sequence[int]) -> None:
        """Fail the next ``len(errors)`` requests of type ``api`` with these codes, in order.

        ``api`` is a request name ("Produce", "InitProducerId", "TxnOffsetCommit", ...) or its int ApiKey;
        ``errors`` are ``confluent_kafka.KafkaError.<NAME>`` codes. ``KafkaError._TRANSPORT`` makes the
        broker drop the connection instead of answering.
        """
        self._command({"cmd": "push_request_errors", "api": api_key(api), "errors": error_codes(errors)})

    def set_rtt(self, broker_id: int, rtt_ms: int) -> None:
        """Delay every response of a broker (-1: all) by ``rtt_ms`` milliseconds (0 removes the delay)."""
        self._command({"cmd": "set_rtt", "broker_id": broker_id, "rtt_ms": rtt_ms})

    def set_coordinator(self, key_type: str, key: str, broker_id: int) -> None:
        """Make ``broker_id`` the coordinator of a ``key``.

        ``key_type`` is ``"transaction"`` (key = transactional.id) or ``"group"`` (key = group.id).
        The broker need not exist, which leaves the coordinator unreachable.
        """
        if key_type not in COORDINATOR_KEY_TYPES:
            raise ValueError(f"key_type must be one of {COORDINATOR_KEY_TYPES}, got {key_type!r}")
        self._command({"cmd": "set_coordinator", "key_type": key_type, "key": key, "broker_id": broker_id})

    # -- the child process -------------------------------------------------------------------------

    def _command(self, command: dict[str, Any]) -> None:
        what = command["cmd"]
        with self._lock:
            proc = self._proc
            if proc is None or proc.stdin is None:
                raise ClusterError(f"cannot {what}: mock cluster is not running (call start())")
            try:
                proc.stdin.write(json.dumps(command).encode() + b"\n")
                proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                # The read below reports the exit code and the child's last words.
                pass
            reply = self._read_reply(what, self.command_timeout)
        if reply.get("ok") is not True:
            raise ClusterError(f"mock cluster refused {what}: {reply.get('error', reply)}")

    def _read_reply(self, what: str, timeout: float) -> dict[str, Any]:
        """Read one JSON line from the child within ``timeout`` seconds; ClusterError if it dies or stalls."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._terminate(proc)
                raise ClusterError(
                    f"mock cluster (pid {proc.pid}) did not answer {what} within {timeout:.1f}s; "
                    f"it was terminated. Its log ends with:\n{self._stderr_tail()}"
                )
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 65_536)
            if not chunk:
                code = self._reap(proc)
                raise ClusterError(
                    f"mock cluster (pid {proc.pid}) exited with code {code} during {what}. "
                    f"Its log ends with:\n{self._stderr_tail()}"
                )
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise ClusterError(
                f"mock cluster answered {what} with something other than a JSON object: {line!r}"
            )
        return reply

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return "(no log)"
        self._stderr.flush()
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - _STDERR_TAIL_BYTES))
        return self._stderr.read().decode(errors="replace").strip() or "(empty log)"

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes]) -> int | None:
        # EOF on stdout usually means the child is exiting; give it a moment to be reaped.
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes]) -> None:
        # Only this object's own child is ever signalled.
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _shutdown(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        self._bootstrap_servers = None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(BrokenPipeError):
                    proc.stdin.close()  # EOF: the child destroys the cluster and exits by itself
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("mock cluster (pid %d) ignored EOF for %.1fs; terminating it", proc.pid, timeout)
                self._terminate(proc)
            if proc.returncode != 0:
                log.warning(
                    "mock cluster (pid %d) exited with code %s; its log ends with:\n%s",
                    proc.pid,
                    proc.returncode,
                    self._stderr_tail(),
                )
            if proc.stdout is not None:
                proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        self._buffer = b""
