"""Connector pieces that need neither Spark nor Kafka: option validation, input schema checks and the
batch-independent fingerprint that lets a retry prove it resumes the same input."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pytest
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructType

from reliable_kafka.errors import ConfigError
from reliable_kafka.spark.fingerprint import Fingerprint
from reliable_kafka.spark.options import reader_options, writer_options
from reliable_kafka.spark.writer import check_input_schema

BOOT = {"kafka.bootstrap.servers": "127.0.0.1:9"}


def _digest(batches: list[pa.RecordBatch], seed: str = "") -> str:
    fp = Fingerprint(seed)
    for batch in batches:
        fp.update(batch)
    return fp.digest()


def _rows(keys: Sequence[bytes | None], values: Sequence[bytes | None]) -> pa.RecordBatch:
    return pa.record_batch([pa.array(keys, pa.binary()), pa.array(values, pa.binary())], names=["key", "value"])


def test_fingerprint_ignores_batch_boundaries_and_sees_every_change() -> None:
    keys = [None if i % 7 == 0 else f"k{i}".encode() for i in range(100)]
    values = [f"value-{i}".encode() for i in range(100)]
    whole = _rows(keys, values)
    split = [whole.slice(0, 13), whole.slice(13, 50), whole.slice(63)]
    assert _digest([whole]) == _digest(split)
    assert _digest([whole]) == _digest([_rows(keys[:40], values[:40]), _rows(keys[40:], values[40:])])

    changed = list(values)
    changed[57] = b"value-57!"
    assert _digest([_rows(keys, changed)]) != _digest([whole])
    assert _digest([_rows(keys[:-1], values[:-1])]) != _digest([whole]), "a missing row"
    assert _digest([whole], seed="other-topic") != _digest([whole])
    # Where one row ends and the next starts, and null versus empty, both count.
    assert _digest([_rows([None, None], [b"ab", b"c"])]) != _digest([_rows([None, None], [b"a", b"bc"])])
    assert _digest([_rows([None], [b"x"])]) != _digest([_rows([b""], [b"x"])])


def test_taking_a_digest_does_not_change_the_fingerprint() -> None:
    fp = Fingerprint()
    fp.update(_rows([None] * 3, [b"a", b"b", b"c"]))
    prefix = fp.digest()
    assert fp.digest() == prefix
    fp.update(_rows([None], [b"d"]))
    assert fp.digest() != prefix
    assert fp.digest() == _digest([_rows([None] * 4, [b"a", b"b", b"c", b"d"])])


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"guarantee": "exactly_once", "topic": "t"}, "write_id"),
        ({"guarantee": "twice"}, "guarantee"),
        ({"kafka.acks": "1", "topic": "t"}, "acks"),
        ({"kafka.enable.idempotence": "false", "topic": "t"}, "enable.idempotence"),
        ({"kafka.transactional.id": "mine", "topic": "t"}, "kafka.transactional.id"),
        ({"write_id": "has space"}, "write_id"),
        ({"chunkSeconds": "30", "transactionTimeoutMs": "60000"}, "chunkSeconds"),
    ],
)
def test_writer_refuses_unsafe_or_invalid_options(options: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        writer_options({**BOOT, **options})
    assert refused.value.key == key


def test_writer_needs_brokers_and_generates_an_at_least_once_write_id() -> None:
    with pytest.raises(ConfigError, match="bootstrap.servers"):
        writer_options({"topic": "t"})
    first, second = writer_options({**BOOT, "topic": "t"}), writer_options({**BOOT, "topic": "t"})
    assert first.guarantee == "at_least_once" and first.write_id != second.write_id
    settings = writer_options({**BOOT, "guarantee": "exactly_once", "write_id": "w"}).producer_settings("tid")
    assert settings["transactional.id"] == "tid"
    assert int(settings["message.timeout.ms"]) <= int(settings["transaction.timeout.ms"])


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"subscribe": "a", "assign": '{"a": [0]}'}, "subscribe"),
        ({}, "subscribe"),
        ({"assign": "[0]"}, "assign"),
        ({"subscribe": "a", "kafka.isolation.level": "read_uncommitted"}, "isolation.level"),
        ({"subscribe": "a", "startingOffsets": "committed"}, "kafka.group.id"),
        ({"subscribe": "a", "endingOffsets": '{"a": {"0": "x"}}'}, "endingOffsets"),
        ({"subscribe": "a", "dedupByRkId": "maybe"}, "dedupByRkId"),
    ],
)
def test_reader_refuses_invalid_options(options: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        reader_options({**BOOT, **options})
    assert refused.value.key == key


@pytest.mark.parametrize(
    ("schema", "key"),
    [
        (StructType().add("key", StringType()), "value"),
        (StructType().add("value", LongType()), "value"),
        (StructType().add("value", BinaryType()).add("partition", LongType()), "partition"),
        (StructType().add("value", BinaryType()).add("topic", IntegerType()), "topic"),
        (StructType().add("value", BinaryType()).add("headers", StringType()), "headers"),
    ],
)
def test_writer_refuses_input_a_kafka_sink_cannot_write(schema: StructType, key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_input_schema(schema, writer_options({**BOOT, "topic": "t"}))
    assert refused.value.key == key


def test_writer_needs_a_topic_option_or_column() -> None:
    no_topic = writer_options(BOOT)
    with pytest.raises(ConfigError, match="topic"):
        check_input_schema(StructType().add("value", StringType()), no_topic)
    check_input_schema(StructType().add("value", StringType()).add("topic", StringType()), no_topic)
