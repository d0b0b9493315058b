"""The reliable_kafka streaming source: every committed record exactly once across micro-batches,
restarts and added partitions, none of an aborted transaction; maxOffsetsPerTrigger, failOnDataLoss and
the group-offset commit, on the real cluster and the session's Spark."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, IsolationLevel, Producer, TopicPartition
from confluent_kafka.admin import NewPartitions, OffsetSpec

from reliable_kafka.errors import ConfigError
from reliable_kafka.spark import FORMAT, register
from reliable_kafka.spark.options import stream_reader_options
from reliable_kafka.spark.stream_reader import fair_shares
from reliable_kafka.testing.gates import wait_for
from reliable_kafka.testing.verify import verdict
from tests.spark.jobs import produce_with_aborted_transactions

pytestmark = [pytest.mark.spark]

BOOT = {"kafka.bootstrap.servers": "127.0.0.1:9", "subscribe": "t"}
CONNECT_BACK = "Python worker failed to connect back"
STARTS = 3  # starts of one query that may fail to bring up the source's Python worker
log = logging.getLogger(__name__)


class Run:
    """What one streaming query handed its foreachBatch sink: each micro-batch's values, by batch id."""

    def __init__(self, on_batch: Callable[[int], None] | None = None) -> None:
        self.batches: dict[int, list[bytes]] = {}
        self.attempts: dict[int, int] = {}
        self.on_batch = on_batch  # called in the sink with the batch id, after the batch is stored

    def values(self) -> list[bytes]:
        return [v for batch in self.batches.values() for v in batch]


def run_available_now(
    spark: Any, bootstrap: str, topic: str, checkpoint: Path, run: Run, *,
    fail_after_batch: int | None = None, timeout_s: float = 60.0, **options: Any,
) -> None:
    """Read `topic` with trigger(availableNow=True) until what was committed at the start is read.

    The sink keeps one copy per batch id, as an idempotent sink does: a batch that Spark runs again
    after a restart replaces its first copy. With fail_after_batch the sink fails once that batch is
    stored (a crash after the output was written, before Spark recorded the batch as done).
    """
    register(spark)

    def sink(df: Any, batch_id: int) -> None:
        run.batches[batch_id] = [r.value for r in df.select("value").collect()]
        run.attempts[batch_id] = run.attempts.get(batch_id, 0) + 1
        if run.on_batch is not None:
            run.on_batch(batch_id)
        if batch_id == fail_after_batch:
            raise RuntimeError(f"injected failure after batch {batch_id} was written")

    reader = spark.readStream.format(FORMAT).option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
    for key, value in options.items():
        reader = reader.option(key, str(value))
    for start in range(1, STARTS + 1):
        handed = dict(run.attempts)
        query = (reader.load().writeStream.foreachBatch(sink).option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        try:
            assert query.awaitTermination(timeout_s), f"the query did not finish in {timeout_s}s"
            return
        except Exception as e:
            # The driver starts the source's Python worker when the query starts and gives it a fixed
            # 10 s to connect back; on a starved host that start can fail before any batch. Spark
            # restarts such a query from its checkpoint, and so does this: only when nothing reached
            # the sink, so every batch the test counts ran exactly as often as it says.
            if CONNECT_BACK not in str(e) or run.attempts != handed or start == STARTS:
                raise
            log.warning("start %d of the query failed before any batch (%s); starting it again", start, CONNECT_BACK)
        finally:
            if query.isActive:
                query.stop()


def stable_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    """Each partition's last stable offset, asked of Kafka directly (not through the source)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.list_offsets({TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)},
                                 isolation_level=IsolationLevel.READ_COMMITTED, request_timeout=10)
    return {tp.partition: f.result().offset for tp, f in futures.items()}


# ---- pure pieces --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "limit", "expected"),
    [
        ({0: 100, 1: 100}, 50, {0: 25, 1: 25}),
        ({0: 10, 1: 100, 2: 100}, 100, {0: 10, 1: 45, 2: 45}),  # what p0 cannot use goes to the others
        ({0: 0, 1: 7}, 100, {0: 0, 1: 7}),  # less than the limit: all of it
        ({0: 5, 1: 5, 2: 5}, 2, {0: 1, 1: 1, 2: 0}),  # fewer offsets than partitions
        ({0: 3, 1: 1000}, 1000, {0: 3, 1: 997}),
    ],
)
def test_fair_shares_split_the_limit_max_min_fair(available, limit, expected) -> None:
    keyed = {("t", p): n for p, n in available.items()}
    shares = fair_shares(keyed, limit)
    assert shares == {("t", p): n for p, n in expected.items()}
    assert sum(shares.values()) == min(limit, sum(available.values()))


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"endingOffsets": "latest"}, "endingOffsets"),
        ({"commitGroupOffsets": "true"}, "kafka.group.id"),
        ({"maxOffsetsPerTrigger": "0"}, "maxOffsetsPerTrigger"),
        ({"failOnDataLoss": "maybe"}, "failOnDataLoss"),
    ],
)
def test_stream_options_are_refused_with_the_option_named(options, key) -> None:
    with pytest.raises(ConfigError) as caught:
        stream_reader_options({**BOOT, **options})
    assert caught.value.key == key


# ---- on the cluster -------------------------------------------------------------------------------


@pytest.mark.cluster
def test_stream_reads_committed_records_once_in_limited_batches(spark, kafka, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=3)
    committed, aborted = produce_with_aborted_transactions(kafka.bootstrap_servers, topic, 3)
    limit = 400
    run = Run()

    run_available_now(spark, kafka.bootstrap_servers, topic, tmp_path / "cp", run, maxOffsetsPerTrigger=limit)

    v = verdict(committed, run.values())
    assert (v.acked, v.consumed, v.lost, v.duplicates) == (len(committed), len(committed), 0, 0), v
    assert not set(run.values()) & set(aborted)
    # Every micro-batch but the last takes exactly `limit` offsets (records, aborted ones and
    # transaction markers), so the count of batches follows from the log's size alone.
    offsets = sum(stable_offsets(kafka.bootstrap_servers, topic, 3).values())
    assert offsets > len(committed) + len(aborted)  # the transaction markers took offsets too
    assert sorted(run.batches) == list(range(math.ceil(offsets / limit)))
    assert all(0 < len(batch) <= limit for batch in run.batches.values())


@pytest.mark.cluster
def test_stream_restarts_from_its_checkpoint_without_loss_or_duplicates(spark, kafka, make_topic, tmp_path) -> None:
    boot = kafka.bootstrap_servers
    topic = make_topic(partitions=3)
    committed, aborted = produce_with_aborted_transactions(boot, topic, 3, tag="a", rounds=4)
    checkpoint = tmp_path / "cp"
    run = Run()

    # The sink fails after writing batch 1: Spark has recorded the batch's offsets but not its end.
    with pytest.raises(Exception, match="injected failure after batch 1"):
        run_available_now(spark, boot, topic, checkpoint, run, fail_after_batch=1, maxOffsetsPerTrigger=400)
    first_copy = sorted(run.batches[1])
    run_available_now(spark, boot, topic, checkpoint, run, maxOffsetsPerTrigger=400)
    assert run.attempts[1] == 2, "the failed batch was not run again: the restart proved nothing"
    assert sorted(run.batches[1]) == first_copy, "the replayed batch read other records than its first run"
    assert len(run.values()) == len(committed)

    # More records, and a partition added to the topic, while the query is down.
    more, more_aborted = produce_with_aborted_transactions(boot, topic, 3, tag="b", rounds=2)
    admin = kafka.admin()
    admin.create_partitions([NewPartitions(topic, 4)])[topic].result(30)
    assert wait_for(lambda: len(admin.list_topics(topic, timeout=5).topics[topic].partitions) == 4, timeout_s=30)
    last, last_aborted = produce_with_aborted_transactions(boot, topic, 4, tag="c", rounds=2)
    assert stable_offsets(boot, topic, 4)[3] > 0
    batches_before = len(run.batches)
    run_available_now(spark, boot, topic, checkpoint, run, maxOffsetsPerTrigger=400)

    assert len(run.batches) > batches_before
    everything = committed + more + last
    v = verdict(everything, run.values())
    assert (v.acked, v.consumed, v.lost, v.duplicates) == (len(everything), len(everything), 0, 0), v
    assert not set(run.values()) & set(aborted + more_aborted + last_aborted)


@pytest.mark.cluster
def test_stream_commits_the_group_offsets_after_each_batch(spark, kafka, make_topic, tmp_path) -> None:
    boot = kafka.bootstrap_servers
    topic = make_topic(partitions=2)
    committed, _ = produce_with_aborted_transactions(boot, topic, 2, rounds=2)
    group = f"rk-stream-{uuid.uuid4().hex[:8]}"
    admin = kafka.admin()

    def group_offsets() -> dict[int, int]:
        request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic, p) for p in range(2)])
        found = admin.list_consumer_group_offsets([request])[group].result(30)
        return {tp.partition: tp.offset for tp in found.topic_partitions}

    seen: dict[int, int] = {}  # batch id -> how far the group was while the batch ran
    run = Run(on_batch=lambda batch_id: seen.__setitem__(batch_id, sum(group_offsets().values())))

    run_available_now(spark, boot, topic, tmp_path / "cp", run, maxOffsetsPerTrigger=150,
                      commitGroupOffsets="true", **{"kafka.group.id": group})

    assert len(run.values()) == len(committed)
    assert len(run.batches) >= 3
    # While batch n runs the group holds the end of batch n-1: it moves forward with every batch.
    assert [seen[b] for b in sorted(seen)] == sorted(set(seen.values())), seen
    # After the last batch, the group's offsets are the end of the log: its lag is zero.
    assert group_offsets() == stable_offsets(boot, topic, 2)


@pytest.mark.cluster
def test_stream_stops_on_deleted_records_unless_fail_on_data_loss_is_false(spark, kafka, make_topic, tmp_path) -> None:
    boot = kafka.bootstrap_servers
    topic = make_topic(partitions=1)
    producer = Producer({"bootstrap.servers": boot, "enable.idempotence": True})

    def produce(start: int, count: int) -> list[bytes]:
        values = [f"r{i}".encode() for i in range(start, start + count)]
        for value in values:
            producer.produce(topic, value, partition=0)
        assert producer.flush(30) == 0
        return values

    first = produce(0, 500)
    checkpoint = tmp_path / "cp"
    run = Run()
    run_available_now(spark, boot, topic, checkpoint, run)
    assert sorted(run.values()) == sorted(first)

    # Records the query has not read yet are deleted (as retention would) while it is down.
    later = produce(500, 1000)
    assert kafka.delete_records(topic, {0: 1000}) == {0: 1000}
    with pytest.raises(Exception, match="failOnDataLoss=false"):
        run_available_now(spark, boot, topic, checkpoint, Run())

    skipped = Run()
    run_available_now(spark, boot, topic, checkpoint, skipped, failOnDataLoss="false")
    v = verdict(later[500:], skipped.values())
    assert (v.consumed, v.lost, v.duplicates) == (500, 0, 0), v
    assert not set(skipped.values()) & set(later[:500])

