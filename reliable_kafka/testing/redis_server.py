"""A real redis-server for tests: loopback only, a free port, no persistence, its own temp dir.

It signals only the pid it started, and stop() (also on context exit) leaves no process or file behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from reliable_kafka.errors import ClusterError
from reliable_kafka.testing.cluster import free_port

__all__ = ["RedisServer"]

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"


def _pongs_as(port: int, pid: int) -> bool:
    """True when the server on `port` answers PING with PONG and is process `pid`.

    The pid check matters: if the port was taken, another server would answer while ours fails to bind.
    """
    marker = f"process_id:{pid}\r\n".encode()
    reply = b""
    try:
        with socket.create_connection((_HOST, port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\nINFO server\r\n")
            while marker not in reply and len(reply) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return reply.startswith(b"+PONG") and marker in reply


class RedisServer:
    """One redis-server process bound to 127.0.0.1, started and stopped by this object only.

    Nothing is persisted (``--save "" --appendonly no``): a ``kill()`` + ``restart()`` comes back empty,
    which is how tests show what a dedup store forgets.
    """

    def __init__(
        self, port: int | None = None, *, binary: str = "redis-server", startup_timeout_s: float = 10.0
    ) -> None:
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._port: int | None = port
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise ClusterError("redis-server has no port yet: call start() first")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The pid of the running server, or None when it is not running."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> RedisServer:
        """Start the server (on the same port as before, after a stop/kill) and wait until it PINGs."""
        if self.pid is not None:
            return self
        self._terminate(signal.SIGKILL)  # reap a server that died by itself
        executable = shutil.which(self._binary)
        if executable is None:
            raise ClusterError(
                f"{self._binary!r} is not on PATH: install Redis"
                " (Debian/Ubuntu: apt-get install -y redis-server)"
            )
        if self._port is None:
            self._port = free_port()
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="rk-redis-"))
        log_path = self._dir / "redis.log"
        # The log goes to a file, not a pipe: a pipe nobody reads would block the server once full.
        with log_path.open("ab") as log:
            proc = self._proc = subprocess.Popen(
                [
                    executable,
                    "--bind",
                    _HOST,
                    "--port",
                    str(self._port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--dir",
                    str(self._dir),
                    "--logfile",
                    "",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + self._startup_timeout_s
        while not _pongs_as(self._port, proc.pid):
            if proc.poll() is not None or time.monotonic() > deadline:
                exit_code = proc.poll()
                self._terminate(signal.SIGKILL)
                what = (
                    f"exited with code {exit_code}"
                    if exit_code is not None
                    else f"did not answer PING within {self._startup_timeout_s}s"
                )
                raise ClusterError(
                    f"redis-server on {_HOST}:{self._port} {what}; is the port taken?"
                    f" Its log ({log_path}) ends:\n" + self._log_tail()
                )
            time.sleep(0.02)
        logger.info("redis-server pid %d listening on %s", proc.pid, self.url)
        return self

    def _log_tail(self, lines: int = 20) -> str:
        if self._dir is None:
            return ""
        try:
            return "\n".join((self._dir / "redis.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def _terminate(self, sig: signal.Signals, timeout_s: float = 10.0) -> None:
        """Send `sig` to our own server process (if it still runs) and reap it."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            # A paused server cannot act on SIGTERM: let it run so it can exit.
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("redis-server pid %d ignored %s; killing it", proc.pid, sig.name)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout_s)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; everything it held in memory is gone."""
        self._terminate(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing answers, like a hung host."""
        if self.pid is None:
            raise ClusterError("redis-server is not running: nothing to pause")
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Stop (if running) and start again on the same port, empty."""
        self._terminate(signal.SIGTERM)
        return self.start()

    def stop(self) -> None:
        """Shut the server down and delete its temp dir; harmless when already stopped."""
        self._terminate(signal.SIGTERM)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.stop()  # __exit__ does not run when __enter__ fails: remove the temp dir here
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
