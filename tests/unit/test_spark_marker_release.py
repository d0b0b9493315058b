"""Releasing a stream micro-batch's marker-topic records: which keys a commit tombstones, and what a
stale attempt of a released batch does (tests/spark/test_stream_writer.py runs it in a real stream).

The librdkafka mock stands in for the brokers here; it says nothing about read_committed.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from confluent_kafka import Producer

from reliable_kafka.errors import WriteRefused
from reliable_kafka.spark.markers import (
    Manifest,
    MarkerTopic,
    PartitionMarker,
    Plan,
    completed_keys,
    manifest_key,
    partition_key,
    plan_key,
)
from reliable_kafka.spark.options import writer_options
from reliable_kafka.spark.stream_writer import batch_write_id, previous_batch_write_id
from reliable_kafka.spark.writer import write_partition
from reliable_kafka.testing.mock import MockCluster

pytestmark = pytest.mark.timeout(60)

QUERY = "6f1c2f0e-3b7a-4c1d-9e55-0a4b8d2c7f10"


def _marker(write_id: str, partition: int, rows: int, chunks: int) -> PartitionMarker:
    return PartitionMarker(write_id=write_id, partition=partition, rows=rows, fingerprint="f", chunks=chunks,
                           done=True, attempt=0)


def _manifest(write_id: str, chunks: list[int]) -> Manifest:
    parts = {p: _marker(write_id, p, rows=10 * c, chunks=c) for p, c in enumerate(chunks)}
    return Manifest(write_id=write_id, num_partitions=len(chunks), rows=sum(m.rows for m in parts.values()),
                    partitions=parts)


def test_a_completed_write_holds_its_manifest_and_the_markers_of_partitions_that_committed_a_chunk() -> None:
    # Partition 1 had an empty input: it committed no chunk, so it never wrote a marker to tombstone.
    assert completed_keys(_manifest("w", [2, 0, 1])) == ["w/0", "w/2", "w/manifest"]


@pytest.mark.parametrize(("batch", "previous"), [(1, 0), (2, 1), (10, 9), (11, 10)])
def test_the_previous_batch_is_the_one_numbered_one_less_of_the_same_query(batch: int, previous: int) -> None:
    assert previous_batch_write_id(batch_write_id(QUERY, batch), batch) == batch_write_id(QUERY, previous)


def test_the_first_batch_and_a_write_id_of_another_batch_have_no_previous_batch() -> None:
    assert previous_batch_write_id(batch_write_id(QUERY, 0), 0) is None
    # "-13" ends with "3" but not with "-3": the query id is never cut in the wrong place.
    assert previous_batch_write_id(batch_write_id(QUERY, 13), 3) is None
    assert previous_batch_write_id(batch_write_id(QUERY, 3), 4) is None


@pytest.mark.waits  # ~8 s: the mock's answers to the producers, the marker reads and init_transactions
def test_release_tombstones_a_completed_write_and_a_stale_attempt_of_it_is_refused() -> None:
    with MockCluster(brokers=3) as mock:
        mock.create_topic("markers", partitions=4)
        mock.create_topic("rows", partitions=1)
        markers = MarkerTopic({"bootstrap.servers": mock.bootstrap_servers}, "markers", timeout_s=20)
        done, running = batch_write_id(QUERY, 0), batch_write_id(QUERY, 1)
        producer = Producer({"bootstrap.servers": mock.bootstrap_servers})
        records = {partition_key(w, p): _marker(w, p, rows=10, chunks=1) for w in (done, running) for p in (0, 1)}
        records |= {plan_key(done): Plan(done, 2), manifest_key(done): _manifest(done, [1, 1])}
        for key, record in records.items():
            producer.produce("markers", record.to_bytes(), key.encode(), markers.partition_of(key))
        assert producer.flush(10) == 0

        released = markers.release(done)
        assert sorted(released) == sorted([f"{done}/0", f"{done}/1", f"{done}/manifest", f"{done}/plan"])
        assert markers.lookup(released) == dict.fromkeys(released), "every record of the write is a tombstone"
        # A write without a manifest is not released: its markers are what its retry resumes from.
        assert markers.release(running) == []

        # An attempt of the released batch (a worker that outlived its task) finds a tombstone where its
        # marker was: with nothing to resume from it would write the partition again, so it is refused.
        options = writer_options({"kafka.bootstrap.servers": mock.bootstrap_servers, "topic": "rows",
                                  "guarantee": "exactly_once", "write_id": done, "markerTopic": "markers"})
        rows = [pa.record_batch([pa.array([b"a", b"b"], pa.binary())], names=["value"])]
        with pytest.raises(WriteRefused, match="released"):
            write_partition(options, rows, partition=0, attempt=1, transaction_scope=f"stream-{QUERY}")
