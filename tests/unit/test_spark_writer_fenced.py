"""A fenced exactly_once Spark task reports TransactionFenced, also when produce() only says _FATAL (once no
newer attempt's outcome came to end it with: tests/spark/test_writer_faults.py has both endings for real).

A producer fenced by a newer attempt of its partition answers a later produce() with "Local: Fatal error";
the fence is named only by the producer's fatal error, which confluent-kafka raises once from poll()
instead of handing it to error_cb. The librdkafka mock injects the broker's old-epoch answer (it does not
fence by itself); fencing between real attempts is shown in tests/spark/test_writer_faults.py.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pyarrow as pa
import pytest
from confluent_kafka import KafkaError, KafkaException

from reliable_kafka import kafka_errors
from reliable_kafka.errors import TransactionFenced
from reliable_kafka.spark.options import writer_options
from reliable_kafka.spark.writer import write_partition
from reliable_kafka.testing.mock import MockCluster

pytestmark = pytest.mark.timeout(90)


class _RaisesOnPoll:
    """A client whose poll() raises its fatal error, as confluent-kafka 2.16 does."""

    def __init__(self, error: KafkaError) -> None:
        self.error = error

    def poll(self, _timeout: float) -> int:
        raise KafkaException(self.error)


def test_fatal_error_keeps_the_fatal_error_poll_raises() -> None:
    fence = KafkaError(KafkaError._FENCED, "fenced by newer producer instance", fatal=True)
    watch = kafka_errors.FatalError()
    assert watch.seen(_RaisesOnPoll(fence)) is fence
    assert kafka_errors.is_fenced(KafkaException(KafkaError(KafkaError._FATAL)), watch.seen())
    # A non-fatal error raised by poll() says nothing about a fatal state.
    assert kafka_errors.FatalError().seen(_RaisesOnPoll(KafkaError(KafkaError._TRANSPORT))) is None


@pytest.mark.waits  # 10 s: the fenced attempt's wait for a newer attempt that never comes
def test_a_fenced_task_whose_produce_says_fatal_error_raises_transaction_fenced() -> None:
    with MockCluster(brokers=3) as mock:
        mock.create_topic("rows", partitions=1)
        mock.create_topic("markers", partitions=2)
        options = writer_options({
            "kafka.bootstrap.servers": mock.bootstrap_servers, "topic": "rows", "guarantee": "exactly_once",
            "write_id": "fenced", "markerTopic": "markers",
            # A fenced attempt waits for the newer attempt's outcome until the marker has not moved for the
            # transaction timeout; here no newer attempt exists, so the shortest timeout ends the wait.
            "transactionTimeoutMs": "10000", "chunkSeconds": "3",
        })
        options = dataclasses.replace(options, kafka={**options.kafka, "linger.ms": "0"})
        # The broker's answer to a producer whose epoch a newer attempt bumped.
        mock.push_request_errors("Produce", [KafkaError.INVALID_PRODUCER_EPOCH])

        def rows() -> Iterator[pa.RecordBatch]:
            # Paced so the refused Produce request is answered between two batches: the next produce()
            # meets the fatal state. Bounded: the test fails if no error ever comes.
            for i in range(200):
                yield pa.record_batch([pa.array([b"%d" % i] * 10, pa.binary())], names=["value"])
                time.sleep(0.05)

        with pytest.raises(TransactionFenced) as raised:
            write_partition(options, rows(), partition=0, attempt=0)

    assert raised.value.code == "_FENCED"
    assert "Local: Fatal error" in str(raised.value), "produce() reported only _FATAL"
    assert "old epoch" in str(raised.value), "the message names the producer's fatal error"
