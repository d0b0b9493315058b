"""Delivery accounting in the style of Kafka's own system tests (validate_delivery).

Unique payloads go in, an independent reader reads everything back, and the verdict counts what was
acknowledged but is missing (lost) and what arrived more than once (duplicates).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    acked: int
    consumed: int
    consumed_unique: int
    lost: int
    duplicates: int
    lost_sample: tuple[bytes, ...] = field(default=())

    def as_dict(self) -> dict[str, int]:
        return {
            "acked": self.acked,
            "consumed": self.consumed,
            "consumed_unique": self.consumed_unique,
            "lost": self.lost,
            "duplicates": self.duplicates,
        }


def verdict(acked: Iterable[bytes], consumed: Iterable[bytes]) -> Verdict:
    """lost = acknowledged values never read; duplicates = extra copies of values read more than once."""
    acked_set = set(acked)
    counts = Counter(consumed)
    lost = acked_set - counts.keys()
    duplicates = sum(n - 1 for n in counts.values() if n > 1)
    return Verdict(
        acked=len(acked_set),
        consumed=sum(counts.values()),
        consumed_unique=len(counts),
        lost=len(lost),
        duplicates=duplicates,
        lost_sample=tuple(sorted(lost)[:5]),
    )
