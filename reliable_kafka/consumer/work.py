"""The unit the consumer's parts hand to each other: a tracked record (Work) and the handler types.

Guarantee: none of its own; it sits below every other consumer module, so none of them imports another
just to name a record (no import cycles between the fetcher and the stages it feeds).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Message

Handler = Callable[[Message], Any]
BatchHandler = Callable[[list[Message]], Any]
AsyncHandler = Callable[[Message], Awaitable[Any]]


@dataclass
class Work:
    """A tracked record on its way through the stages."""

    msg: Message
    epoch: int  # its partition's epoch when it was tracked: a completion after a rebalance is stale
    key: str | None  # dedup key claimed for this record, if dedup is on
