"""Shared pieces of the Spark tests: a DataFrame of unique numbered values and an independent read-back.

Values are unique per row, so the set of values read back says what was lost and what was duplicated.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from reliable_kafka.ids import message_id_of
from reliable_kafka.testing import consume_all

PARTITIONS = 4
ROWS_PER_PARTITION = 1_500


def numbered_frame(spark: Any, tag: str, *, partitions: int = PARTITIONS,
                   rows_per_partition: int = ROWS_PER_PARTITION) -> tuple[Any, list[bytes]]:
    """A DataFrame of `partitions` x `rows_per_partition` unique values (deterministic per partition)."""
    from pyspark.sql import functions as F

    total = partitions * rows_per_partition
    df = spark.range(0, total, 1, partitions).select(
        F.concat(F.lit(f"{tag}-"), F.lpad(F.col("id").cast("string"), 8, "0")).cast("binary").alias("value")
    )
    return df, [f"{tag}-{i:08d}".encode() for i in range(total)]


def read_back(bootstrap: str, topic: str, *, isolation_level: str = "read_committed") -> list[Any]:
    """Every record of the topic, read by a plain confluent-kafka consumer (not by our Spark reader)."""
    return list(consume_all(bootstrap, topic, isolation_level=isolation_level, timeout=90))


def ids_by_value(messages: list[Any]) -> dict[bytes, set[str | None]]:
    """The rk-ids each value was written with: one per value means every copy is recognisable."""
    out: dict[bytes, set[str | None]] = defaultdict(set)
    for m in messages:
        out[m.value()].add(message_id_of(m.headers()))
    return out
