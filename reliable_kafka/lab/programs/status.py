"""A consumer program's progress, published for the tests and labs that fault it, and logged for people.

The handler notes each record's partition and offset (two dict stores: the hot path stays cheap); a
thread replaces a small JSON status file every 50 ms (atomically, so a reader never sees half of one)
and logs a line whenever the progress changed, so a member's log shows what it owned, handled and
committed when a partition stalled. Fault gates read the file and compare it with the group's
committed offsets: a kill bites only when handled and committed offsets differ.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from reliable_kafka.testing.child_connection import Connection, connection_of

log = logging.getLogger("reliable_kafka.lab.member")

LOG_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"


class Progress:
    """What this member handled (per partition: the offset after the highest handled) and committed."""

    def __init__(self, status_path: str | None, *, write_every_s: float = 0.05,
                 quiet_log_every_s: float = 10.0) -> None:
        self.handled = 0
        self.next: dict[int, int] = {}
        self.committed: dict[int, int] = {}
        self._path = status_path
        self._write_every_s, self._quiet_log_every_s = write_every_s, quiet_log_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="member-status")
        self._last_logged: tuple[Any, ...] = ()
        self._last_log_at = 0.0
        self._last_log_at_handled = 0

    def record(self, partition: int, offset: int) -> None:
        """Called for every handled record. With worker threads a lost max() race only delays a gate."""
        self.handled += 1
        if offset >= self.next.get(partition, 0):
            self.next[partition] = offset + 1

    def on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's commit report (also for auto-commits): what the group has confirmed for us."""
        if err is not None:
            log.info("commit failed: %s", err)
            return
        for tp in partitions:
            if tp.error is None and tp.offset >= 0:
                self.committed[tp.partition] = tp.offset

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._publish(force_log=True)

    def _run(self) -> None:
        while not self._stop.wait(self._write_every_s):
            self._publish()

    def _publish(self, force_log: bool = False) -> None:
        # No consumer.assignment() from this thread: asked beside a running consume() it waits on
        # librdkafka's main thread while holding the GIL, and rebalance-storm members stopped publishing
        # and logging at once when it did. The consumer logs its assignments and revocations itself.
        handled, nxt, committed = self.handled, dict(self.next), dict(self.committed)
        if self._path is not None:
            tmp = f"{self._path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"handled": handled, "next": nxt, "committed": committed, "pid": os.getpid()}, f)
            os.replace(tmp, self._path)
        # One line a second at most while it changes, one every 10 s while it does not: a stalled
        # partition shows as an owner whose next offset stays put while the topic has more.
        now = time.monotonic()
        state = (handled, tuple(sorted(committed.items())))
        changed, since = state != self._last_logged, now - self._last_log_at
        if force_log or (changed and since >= 1.0) or since >= self._quiet_log_every_s:
            log.info("progress: handled %d (+%d) next %s committed %s", handled,
                     handled - self._last_log_at_handled, dict(sorted(nxt.items())), dict(sorted(committed.items())))
            self._last_logged, self._last_log_at, self._last_log_at_handled = state, now, handled


@dataclass(frozen=True)
class MemberStatus:
    """One reading of a member's status file."""

    handled: int
    next: dict[int, int]
    pid: int

    @classmethod
    def read(cls, path: Path) -> MemberStatus | None:
        """The member's last published status, or None before its first one."""
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(handled=raw["handled"], next={int(p): o for p, o in raw["next"].items()}, pid=raw["pid"])

    def uncommitted(self, committed: Mapping[int, int]) -> int:
        """Offsets handled by this member beyond the group's commit: a kill now makes them be handled
        again (redelivery), never skipped. A partition it handled before it was revoked counts nothing:
        the revoke committed what it had handled, and later owners only move the commit on."""
        return sum(max(0, n - committed.get(p, 0)) for p, n in self.next.items())

    def committed_unhandled(self, committed: Mapping[int, int]) -> int:
        """Offsets the group committed that this member has not handled (auto-commit ran ahead of the
        handler): a kill now skips them for good. Only partitions it handled in this life count."""
        return sum(max(0, committed.get(p, 0) - n) for p, n in self.next.items())


class GroupOffsets:
    """The group's committed offsets on one topic, asked of the coordinator (without joining the group).

    `cluster`: the connection settings (a secured cluster's login), or an open cluster's bootstrap servers.
    """

    def __init__(self, cluster: str | Connection, group: str, topic: str, partitions: int) -> None:
        self._tps = [TopicPartition(topic, p) for p in range(partitions)]
        self._consumer = Consumer({**connection_of(cluster), "group.id": group, "enable.auto.commit": False})

    def get(self) -> dict[int, int]:
        """Partition -> committed offset (0 where nothing is committed yet)."""
        return {tp.partition: max(tp.offset, 0) for tp in self._consumer.committed(self._tps, timeout=15)}

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> GroupOffsets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["LOG_FORMAT", "GroupOffsets", "MemberStatus", "Progress"]
