"""The outbox pool: numbered slot files `slot-N.db` in one directory, shared by the processes of one server.

Guarantee: a process owns a slot only while it holds that slot's OutboxLock, so two live processes never
own the same slot; slot files are never deleted, so what a dead or retired process left pending stays in
its slot until a later process claims it as its own or adopts it (`OutboxPool.adoptable`).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reliable_kafka.errors import ConfigError, OutboxCorrupt, OutboxError, OutboxLocked
from reliable_kafka.outbox.front import Outbox
from reliable_kafka.outbox.lock import owner
from reliable_kafka.spool import Durability

log = logging.getLogger("reliable_kafka.outbox")

_SLOT = re.compile(r"slot-(\d+)\.db")


def slot_path(directory: Path, index: int) -> Path:
    return directory / f"slot-{index}.db"


def slot_paths(directory: Path) -> list[Path]:
    """The slot files in `directory`, by number (their -wal, -shm and .lock companions are not slots)."""
    found = [(int(m.group(1)), entry) for entry in directory.iterdir() if (m := _SLOT.fullmatch(entry.name))]
    return [path for _, path in sorted(found)]


@dataclass(frozen=True)
class SlotStatus:
    """One slot as a reader sees it, without taking its lock.

    `owner_pid` is set while a process owns the slot (`locked`); the counts are None when the file could
    not be read, and `problem` says why (a slot being created right now, a damaged file).
    """

    path: Path
    locked: bool
    owner_pid: int | None
    pending: int | None
    failed: int | None
    oldest_pending_age_s: float | None
    file_bytes: int | None
    problem: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "locked": self.locked, "owner_pid": self.owner_pid,
                "pending": self.pending, "failed": self.failed,
                "oldest_pending_age_s": self.oldest_pending_age_s, "file_bytes": self.file_bytes,
                "problem": self.problem}


def slot_status(path: Path) -> SlotStatus:
    """Read one slot's owner (from its lock file) and counts (the file opened read-only): no lock taken."""
    holder = owner(path)
    pid = int(holder) if holder is not None and holder.isdigit() else None
    try:
        with Outbox(path, read_only=True) as outbox:
            s = outbox.stats()
    except OutboxError as exc:
        return SlotStatus(path, holder is not None, pid, None, None, None, None, str(exc))
    return SlotStatus(path, holder is not None, pid, s.pending, s.failed, s.oldest_pending_age_s, s.file_bytes)


def pool_status(directory: str | os.PathLike[str]) -> list[SlotStatus]:
    """Every slot of the pool in `directory`, by number; OutboxError if there is no such directory."""
    root = Path(directory)
    if not root.is_dir():
        raise OutboxError(f"no outbox pool at {root}: it is not a directory (check the --dir / outbox_dir)")
    return [slot_status(path) for path in slot_paths(root)]


class OutboxPool:
    """The owner's side of a pool directory: create it, claim a free slot, find slots to adopt.

    The directory is created if missing; one this process cannot create or write to is a ConfigError
    naming it, raised before any slot is touched.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(os.fspath(directory)).absolute()
        fix = "create it, give this process's user write access to it, or choose another outbox_dir"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError("outbox_dir", f"{self.directory} exists and is not a directory; {fix}") from None
        except OSError as exc:
            raise ConfigError("outbox_dir", f"cannot create the outbox directory {self.directory}: "
                                            f"{exc.strerror}; {fix}") from exc
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise ConfigError("outbox_dir", f"the outbox directory {self.directory} is not writable by this "
                                            f"process (it creates slot-N.db files and their locks there); {fix}")

    def claim(self, *, durability: Durability, max_messages: int) -> Outbox:
        """Open the lowest-numbered slot no live process owns (a new one when all are owned), as its owner.

        The slot's lock decides between processes starting at once: the loser gets OutboxLocked and
        tries the next number. A slot left with pending messages is claimed like an empty one; its new
        owner sends them first. A damaged slot is logged and left untouched.
        """
        for index in itertools.count():
            path = slot_path(self.directory, index)
            try:
                return Outbox(path, durability=durability, max_messages=max_messages)
            except OutboxLocked:
                continue
            except OutboxCorrupt as exc:
                log.error("outbox slot %s is damaged and left untouched (%s); taking another slot", path, exc)
        raise AssertionError("unreachable: itertools.count() does not end")

    def adoptable(self, own: Path) -> list[SlotStatus]:
        """The other slots that no process owns and that still hold pending messages: their owner died,
        or the deployment shrank. Empty ones are not listed; they wait to be claimed as free slots."""
        # Owned slots are skipped before they are opened: their owners are alive and drain them.
        unowned = [path for path in slot_paths(self.directory) if path != own and owner(path) is None]
        return [s for s in map(slot_status, unowned) if not s.locked and s.pending]
