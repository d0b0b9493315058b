"""Dedup stores that turn redeliveries into exactly-once effects: claim a key, run the handler, confirm.

A failed handler releases its claim instead of marking the key done, so no message is lost to dedup;
RedisDedupStore is imported on first use, so the `redis` extra is needed only by those who use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reliable_kafka.dedup.base import ClaimResult, DedupStore, FencedDedupStore, PartitionLease
from reliable_kafka.dedup.sqlite import SQLiteDedupStore, SQLiteInbox

if TYPE_CHECKING:
    from reliable_kafka.dedup.redis import RedisDedupStore, RedisInbox

__all__ = ["ClaimResult", "DedupStore", "FencedDedupStore", "PartitionLease", "RedisDedupStore", "RedisInbox",
           "SQLiteDedupStore", "SQLiteInbox"]


def __getattr__(name: str) -> Any:
    if name in ("RedisDedupStore", "RedisInbox"):
        from reliable_kafka.dedup import redis

        return getattr(redis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
