"""What a lab scenario is and what it reports (the JSON contract of `reliable-kafka lab --json`).

A scenario runs its fault once for the control client and once for reliable_kafka on the same
cluster and returns one result per client; it leaves the cluster healthy when it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from reliable_kafka.testing.cluster import LocalKafkaCluster

CONTROL = "control"
RELIABLE = "reliable_kafka"


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    client: str  # CONTROL or RELIABLE
    acked: int
    consumed_unique: int
    lost: int
    duplicates: int
    duplicates_after_dedup: int
    seconds: float
    detail: str = ""

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = round(self.seconds, 2)
        return out


class Progress(Protocol):
    """Told how far a scenario got; the CLI draws a progress bar from it."""

    def __call__(self, step: str, fraction: float) -> None: ...


def no_progress(step: str, fraction: float) -> None:
    return None


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    run: Callable[[LocalKafkaCluster, Progress], list[ScenarioResult]]
    # Optional parts, e.g. ("spark",), and what the cluster must be ("5-node cluster"): the lab
    # says so when they are missing.
    needs: tuple[str, ...] = ()
