"""Deterministic task failures for Spark jobs (tests and the lab), applied upstream of any sink.

fail_attempts() makes chosen task attempts hand some rows downstream and then raise, so Spark's own
Kafka sink and ours see exactly the same failing job; nothing here is used by a real write.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame

from reliable_kafka.spark.markers import MarkerTopic, PartitionMarker, partition_key
from reliable_kafka.spark.options import DEFAULT_MARKER_TOPIC


def fail_attempts(
    df: DataFrame,
    *,
    after_rows: int,
    attempts: tuple[int, ...] | None = (0,),
    partitions: tuple[int, ...] | None = None,
    before_failing: Callable[[], None] | None = None,
) -> DataFrame:
    """`df` whose chosen task attempts pass `after_rows` rows downstream, then raise.

    attempts=None fails every attempt (the job fails once Spark gives up); partitions=None fails all
    partitions. `before_failing` (picklable) runs in the task just before it raises.
    """

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        context = TaskContext.get()
        assert context is not None
        chosen = (attempts is None or context.attemptNumber() in attempts) and (
            partitions is None or context.partitionId() in partitions
        )
        passed = 0
        for batch in batches:
            if chosen and passed + batch.num_rows >= after_rows:
                yield batch.slice(0, after_rows - passed)
                if before_failing is not None:
                    before_failing()
                raise RuntimeError(
                    f"injected failure: partition {context.partitionId()} attempt {context.attemptNumber()} "
                    f"after {after_rows} rows"
                )
            passed += batch.num_rows
            yield batch

    return df.mapInArrow(run, df.schema)


@dataclass(frozen=True)
class UntilCommitted:
    """A before_failing hook: wait until the given partitions of an exactly_once write are complete.

    Makes "the job failed halfway" deterministic: the failing tasks raise only once the others
    committed, so exactly those partitions are done when the job gives up.
    """

    bootstrap_servers: str
    write_id: str
    partitions: tuple[int, ...]
    marker_topic: str = DEFAULT_MARKER_TOPIC
    timeout_s: float = 120.0

    def __call__(self) -> None:
        markers = MarkerTopic({"bootstrap.servers": self.bootstrap_servers}, self.marker_topic)
        keys = [partition_key(self.write_id, p) for p in self.partitions]
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            found = markers.read(keys)
            if all(isinstance(found.get(k), PartitionMarker) and found[k].done for k in keys):  # type: ignore[union-attr]
                return
            time.sleep(0.3)
        raise TimeoutError(f"partitions {self.partitions} of write {self.write_id} did not complete in time")


@dataclass(frozen=True)
class Slow:
    """One rule of slow_attempts(): the chosen task attempts wait `seconds_per_batch` before passing each
    Arrow batch on, from batch number `after_batches` on (the ones before pass at once). attempts=None and
    partitions=None choose all."""

    seconds_per_batch: float
    attempts: tuple[int, ...] | None = (0,)
    partitions: tuple[int, ...] | None = None
    after_batches: int = 0

    def chooses(self, attempt: int, partition: int) -> bool:
        return (self.attempts is None or attempt in self.attempts) and (
            self.partitions is None or partition in self.partitions)


def slow_attempts(df: DataFrame, *rules: Slow) -> DataFrame:
    """`df` whose task attempts are slowed by the first of `rules` that chooses them, in one stage.

    Makes a partition take long enough to be caught mid-write (a fault gated on its progress), or makes
    one attempt a straggler that speculation runs a copy of, with a pace of its own for the copy.

    One mapInArrow for all the rules, because every Python stage between this one and the sink delays
    what the sink sees: PySpark passes a Python worker's output on in 64 KB writes, and the JVM asks for
    the row after a full Arrow batch before it passes that batch on, so a batch reaches the next Python
    stage only once later ones are made. Seen on the standalone cluster: with two such stages a
    straggler's writer got none of its first 6 of 8 batches in 10 s. The sink sees each batch soon after
    it passes only when batches are larger than 64 KB and a few more follow.
    """

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        context = TaskContext.get()
        assert context is not None
        rule = next((r for r in rules if r.chooses(context.attemptNumber(), context.partitionId())), None)
        for n, batch in enumerate(batches):
            if rule is not None and n >= rule.after_batches:
                time.sleep(rule.seconds_per_batch)
            yield batch

    return df.mapInArrow(run, df.schema)
