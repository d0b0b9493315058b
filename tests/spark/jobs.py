"""Shared pieces of the Spark tests: a DataFrame of unique numbered values and an independent read-back.

Values are unique per row, so the set of values read back says what was lost and what was duplicated.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

from confluent_kafka import Producer

from reliable_kafka.ids import message_id_of
from reliable_kafka.testing import consume_all

PARTITIONS = 4
ROWS_PER_PARTITION = 1_500


def numbered_frame(spark: Any, tag: str, *, partitions: int = PARTITIONS,
                   rows_per_partition: int = ROWS_PER_PARTITION, value_bytes: int = 0) -> tuple[Any, list[bytes]]:
    """A DataFrame of `partitions` x `rows_per_partition` unique values (deterministic per partition).

    `value_bytes` pads each value with "x" to that length: a sink downstream of a slowed stage
    (`faults.slow_attempts`) sees its input arrive while it is made only when an Arrow batch is larger
    than PySpark's 64 KB writes; small values reach it all at once at the end.
    """
    from pyspark.sql import functions as F

    total = partitions * rows_per_partition
    number = F.concat(F.lit(f"{tag}-"), F.lpad(F.col("id").cast("string"), 8, "0"))
    if value_bytes:
        assert value_bytes >= len(tag) + 9, "rpad would cut the number off"
        number = F.rpad(number, value_bytes, "x")
    df = spark.range(0, total, 1, partitions).select(number.cast("binary").alias("value"))
    return df, [f"{tag}-{i:08d}".ljust(value_bytes, "x").encode() for i in range(total)]


def read_back(bootstrap: str, topic: str, *, isolation_level: str = "read_committed") -> list[Any]:
    """Every record of the topic, read by a plain confluent-kafka consumer (not by our Spark reader)."""
    return list(consume_all(bootstrap, topic, isolation_level=isolation_level, timeout=90))


def ids_by_value(messages: list[Any]) -> dict[bytes, set[str | None]]:
    """The rk-ids each value was written with: one per value means every copy is recognisable."""
    out: dict[bytes, set[str | None]] = defaultdict(set)
    for m in messages:
        out[m.value()].add(message_id_of(m.headers()))
    return out


def produce_with_aborted_transactions(
    bootstrap: str, topic: str, partitions: int, *, tag: str = "", rounds: int = 6
) -> tuple[list[bytes], list[bytes]]:
    """Committed and aborted transactions interleaved with plain idempotent writes over `partitions`
    partitions; returns the (committed, aborted) values, unique per `tag`."""
    txn = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"rk-test-{uuid.uuid4().hex}"})
    plain = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    txn.init_transactions(30)
    committed: list[bytes] = []
    aborted: list[bytes] = []
    for round_no in range(rounds):
        txn.begin_transaction()
        values = [f"{tag}txn{round_no}-{i}".encode() for i in range(200)]
        for i, value in enumerate(values):
            txn.produce(topic, value, partition=i % partitions)
        if round_no % 2:
            # Flush first: an abort while the records are still unsent can race librdkafka's
            # partition registration and fail INVALID_TXN_STATE (librdkafka issue 4849). Flushed,
            # the aborted records are really in the log, which is what the reader must skip.
            assert txn.flush(30) == 0
            txn.abort_transaction(30)
            aborted += values
        else:
            txn.commit_transaction(30)
            committed += values
        extra = [f"{tag}plain{round_no}-{i}".encode() for i in range(50)]
        for i, value in enumerate(extra):
            plain.produce(topic, value, partition=i % partitions)
        assert plain.flush(30) == 0
        committed += extra
    return committed, aborted
