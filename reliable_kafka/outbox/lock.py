"""One owner per outbox file: an exclusive flock on `<outbox>.lock`, held for the Outbox's lifetime.

A second opener, in this process or another, gets OutboxLocked naming the owner's pid; read-only
viewers take no lock, and owner() tells who holds it without taking it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from reliable_kafka.errors import OutboxError, OutboxLocked


class OutboxLock:
    """An exclusive flock on `<outbox>.lock`; the file holds the owner's pid.

    The lock file is never deleted: unlinking it would let a third opener lock a fresh inode while a
    second one still waits on the old one, and two processes would both believe they own the outbox.
    """

    def __init__(self, db_path: Path) -> None:
        self.path = db_path.with_name(db_path.name + ".lock")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutboxError(
                f"cannot create the lock file {self.path} for outbox {db_path}: {exc.strerror}; "
                "the outbox directory must be writable by this process"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise OutboxLocked(
                f"outbox {db_path} is owned by another producer (pid {holder}, lock file {self.path}); "
                "one outbox file serves one process: give each producer its own outbox path (or let the "
                "processes of one server share outbox_dir=, a pool of slot files), or stop the other one "
                "(read-only tools such as `reliable-kafka outbox status` work meanwhile)"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise OutboxError(f"cannot lock {self.path} for outbox {db_path}: {exc.strerror}") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _pid_in(fd: int) -> str:
    """The pid an owner wrote into its lock file ("unknown" in the instant between its flock and its write)."""
    return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"


def owner(db_path: Path) -> str | None:
    """The pid (as written in `<outbox>.lock`) of the process that owns the outbox now, or None if none does.

    Never creates the lock file and never takes the lock for more than an instant: a shared flock tried
    without waiting, then dropped. An opener that tries the exclusive lock in that same instant gets
    OutboxLocked as if the file were owned; the outbox pool treats that slot as taken and its adopter
    looks again on its next scan, so nothing is left behind by it. The pid left in the file by a dead
    owner is not reported: a lock nobody holds has no owner.
    """
    try:
        fd = os.open(db_path.with_name(db_path.name + ".lock"), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _pid_in(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
