"""Shared pieces of lab scenarios: unique topics, the bare control producer, the independent reader
and the counting of what was lost and duplicated (before and after dedup by rk-id).

Every client here and in the programs a scenario starts is given the cluster's whole connection
(`cluster.client_config()`: its login too, on a secured cluster), controls included.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from reliable_kafka.backpressure import produce_when_room
from reliable_kafka.ids import message_id_of
from reliable_kafka.lab.base import CONTROL, RELIABLE, ScenarioResult
from reliable_kafka.testing.child_connection import Connection, child_env
from reliable_kafka.testing.cluster import LocalKafkaCluster, consume_all
from reliable_kafka.testing.verify import verdict


def topic_name(scenario: str, client: str) -> str:
    return f"lab-{scenario}-{client}-{uuid.uuid4().hex[:6]}"


@dataclass
class StreamProgress:
    """How far a bare stream has got, read by a fault gate in another thread while the stream runs."""

    total: int = 0
    produced: int = 0
    acked: list[bytes] = field(default_factory=list)


def bare_produce(connection: Connection, topic: str, values: Sequence[bytes], *, rate: float | None = None,
                 progress: StreamProgress | None = None, **conf: Any) -> list[bytes]:
    """The control client: plain confluent-kafka; returns the values whose delivery report said success.

    `rate` (messages/s) paces the stream, so that a fault injected a moment after the start finds it
    still running on a fast machine instead of finished and fully replicated. `progress`, when given,
    is kept up to date as the stream runs (its `acked` is the list returned), so a gate can aim a fault
    at the moment the leader has acknowledged records and more are still to come.
    """
    progress = progress if progress is not None else StreamProgress()
    progress.total = len(values)
    acked = progress.acked
    started = time.monotonic()

    def on_delivery(err: Any, msg: Any) -> None:
        if err is None:
            acked.append(msg.value())

    p = Producer({**connection, "linger.ms": 5, **conf})
    for i, v in enumerate(values):
        produce_when_room(p, topic, v, on_delivery=on_delivery)
        progress.produced = i + 1
        p.poll(0)
        if rate is not None and i % 100 == 99:
            ahead = (i + 1) / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
    p.flush(60)
    return acked


def read_back(connection: Connection, topic: str, *, isolation_level: str = "read_committed") -> list[Any]:
    """Every record of `topic`, read by an independent reader (no group) that logs in as `connection` says."""
    return list(consume_all(connection["bootstrap.servers"], topic, isolation_level=isolation_level,
                            config=connection))


def count(
    name: str, client: str, acked: Iterable[bytes], connection: Connection, topic: str, started: float,
    detail: str = "",
) -> ScenarioResult:
    """Read the topic back with an independent read_committed reader and count."""
    msgs = read_back(connection, topic)
    return result_from(name, client, acked, [(m.value(), message_id_of(m.headers())) for m in msgs], started,
                       detail)


def result_from(
    name: str, client: str, acked: Iterable[bytes], seen: Sequence[tuple[bytes, str | None]], started: float,
    detail: str = "",
) -> ScenarioResult:
    """Count from (value, rk-id) pairs that were read or handled.

    duplicates_after_dedup is what is left once repeated rk-ids are dropped, as a dedup store keyed
    by rk-id would; records without an rk-id (the control's) cannot be deduplicated that way.
    """
    v = verdict(acked, [value for value, _ in seen])
    by_value: Counter[bytes] = Counter()
    seen_ids: set[str] = set()
    for value, mid in seen:
        if mid is not None:
            if mid in seen_ids:
                continue
            seen_ids.add(mid)
        by_value[value] += 1
    after = sum(n - 1 for n in by_value.values() if n > 1)
    return ScenarioResult(
        name=name, client=client, acked=v.acked, consumed_unique=v.consumed_unique, lost=v.lost,
        duplicates=v.duplicates, duplicates_after_dedup=after, seconds=time.monotonic() - started, detail=detail,
    )


def run_program(module: str, args: Sequence[str], connection: Connection) -> subprocess.Popen[bytes]:
    """Start one of reliable_kafka.lab.programs as a child process (only it is ever signalled); it gets
    `connection` in its environment, never in `args` (see testing.child_connection)."""
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=child_env(connection))


def ledger_entries(path: Path) -> list[tuple[bytes, str | None]]:
    """(value, rk-id) per line of a consumer program's ledger ("value<TAB>rk-id")."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        value, _, mid = line.partition("\t")
        out.append((value.encode(), mid or None))
    return out


__all__ = ["CONTROL", "RELIABLE", "Connection", "LocalKafkaCluster", "bare_produce", "count", "ledger_entries",
           "read_back", "result_from", "run_program", "topic_name"]
