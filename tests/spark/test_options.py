"""The connector's options: validation (no Spark or Kafka needed), input schema checks, the batch-independent
fingerprint that lets a retry prove it resumes the same input, and, with Spark and the real cluster, the
Spark Kafka source options that choose which records a read returns."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from confluent_kafka import Producer
from pyspark.sql.types import BinaryType, IntegerType, LongType, StringType, StructType

from reliable_kafka.errors import ConfigError
from reliable_kafka.spark import FORMAT
from reliable_kafka.spark.fingerprint import Fingerprint
from reliable_kafka.spark.options import READER_OPTIONS, READER_REFUSED, reader_options, writer_options
from reliable_kafka.spark.reader import OffsetRange, split_ranges
from reliable_kafka.spark.writer import check_input_schema
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS
from reliable_kafka.testing.verify import verdict
from tests.fixtures.requirements import missing

ROOT = Path(__file__).resolve().parents[2]

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
        ({"topic": "t", "kafka.max.request.size": "2000000"}, "kafka.max.request.size"),
        ({"topic": "t", "kafka.sasl.jaas.config": "x required;"}, "kafka.sasl.jaas.config"),
        ({"topic": "t", "gaurantee": "exactly_once"}, "gaurantee"),
        ({"topic": "t", "path": "orders"}, "path"),
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
        ({"subscribe": "a", "kafka.auto.offset.reset": "latest"}, "kafka.auto.offset.reset"),
        ({"subscribe": "a", "kafka.fetch.max.wait.ms": "100"}, "kafka.fetch.max.wait.ms"),
        ({"subscribe": "a", "startingTimestamp": "yesterday"}, "startingTimestamp"),
        ({"subscribe": "a", "endingTimestamp": "-5"}, "endingTimestamp"),
        ({"subscribe": "a", "startingOffsetsByTimestamp": '{"a": {"0": "x"}}'}, "startingOffsetsByTimestamp"),
        ({"subscribe": "a", "endingOffsetsByTimestamp": "[1]"}, "endingOffsetsByTimestamp"),
        ({"subscribe": "a", "startingOffsetsByTimestampStrategy": "earliest"}, "startingOffsetsByTimestampStrategy"),
        ({"subscribe": "a", "minPartitions": "0"}, "minPartitions"),
        ({"subscribe": "a", "maxRecordsPerPartition": "many"}, "maxRecordsPerPartition"),
        ({"subscribe": "a", "failOnDataLoss": "sometimes"}, "failOnDataLoss"),
        ({"subscribe": "a", "groupIdPrefix": " "}, "groupIdPrefix"),
        ({"subscribe": "a", "dedupByRkId": "true", "minPartitions": "8"}, "minPartitions"),
        ({"subscribe": "a", "kafkaConsumer.pollTimeoutMs": "512"}, "kafkaConsumer.pollTimeoutMs"),
        ({"subscribe": "a", "maxOffsetsPerTrigger": "1000"}, "maxOffsetsPerTrigger"),
        ({"subscribe": "a", "startingOffset": "earliest"}, "startingOffset"),
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


def test_unknown_and_refused_names_say_what_to_do_and_a_streaming_side_can_take_more() -> None:
    with pytest.raises(ConfigError, match="did you mean startingOffsets"):
        reader_options({**BOOT, "subscribe": "a", "startingOffset": "earliest"})
    # Spark hands options over lower-cased: the hint still names the option as documented.
    with pytest.raises(ConfigError, match="did you mean maxRecordsPerPartition"):
        reader_options({**BOOT, "subscribe": "a", "maxrecordsperpartitio": "10"})
    with pytest.raises(ConfigError, match="readTimeoutSeconds"):
        reader_options({**BOOT, "subscribe": "a", "kafkaconsumer.polltimeoutms": "512"})
    with pytest.raises(ConfigError, match="did you mean guarantee"):
        writer_options({**BOOT, "topic": "t", "guarantees": "exactly_once"})
    streaming = reader_options({**BOOT, "subscribe": "a", "maxOffsetsPerTrigger": "10", "checkpointLocation": "/c"},
                               extra_names=("maxOffsetsPerTrigger", "checkpointLocation"))
    assert streaming.subscribe == ("a",)
    writer_options({**BOOT, "topic": "t", "checkpointLocation": "/c"}, extra_names=("checkpointLocation",))
    # No name is both taken and refused.
    assert not {n.lower() for n in READER_OPTIONS} & {n.lower() for n in READER_REFUSED}


def test_reader_takes_spark_source_options() -> None:
    opts = reader_options({
        **BOOT, "subscribe": "a", "startingTimestamp": "1700000000000", "endingOffsetsByTimestamp":
        '{"a": {"0": 1700000001000}}', "startingOffsetsByTimestampStrategy": "LATEST", "failOnDataLoss": "false",
        "minPartitions": "6", "groupIdPrefix": "etl", "includeHeaders": "true",
    })
    assert (opts.starting_timestamp, opts.ending_offsets_by_timestamp) == (1700000000000, {"a": {"0": 1700000001000}})
    assert (opts.timestamp_strategy, opts.fail_on_data_loss, opts.min_partitions) == ("latest", False, 6)
    settings = opts.consumer_settings()
    assert settings["group.id"].startswith("etl-") and settings["auto.offset.reset"] == "earliest"
    assert reader_options({**BOOT, "subscribe": "a"}).consumer_settings()["auto.offset.reset"] == "error"


def _covered(pieces: list[OffsetRange]) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    for p in pieces:
        out.setdefault((p.topic, p.partition), []).extend(range(p.start, p.end))
    return out


def test_split_ranges_covers_every_offset_once_as_sparks_range_calculator() -> None:
    ranges = [OffsetRange("a", 0, 0, 1000), OffsetRange("a", 1, 50, 150), OffsetRange("a", 2, 7, 7)]
    whole = _covered(ranges[:2])
    assert split_ranges(ranges) == ranges[:2], "empty ranges are dropped, the others kept as they are"

    by_records = split_ranges(ranges, max_records=300)
    assert max(p.end - p.start for p in by_records) <= 300
    assert len(by_records) == 4 + 1 and _covered(by_records) == whole

    # minPartitions splits in proportion to size: 1000 offsets get about 10 times the tasks of 100.
    by_min = split_ranges(ranges, min_partitions=11)
    assert [sum(1 for p in by_min if p.partition == n) for n in (0, 1)] == [10, 1]
    assert _covered(by_min) == whole
    assert split_ranges(ranges, min_partitions=2) == ranges[:2], "already enough partitions"
    # A range is never cut finer than one offset per piece.
    tiny = split_ranges([OffsetRange("a", 0, 0, 3)], min_partitions=10)
    assert [(p.start, p.end) for p in tiny] == [(0, 1), (1, 2), (2, 3)]


# ---- with Spark and the real cluster -----------------------------------------------------------------------------


def _load(spark: Any, bootstrap: str, topic: str, **options: str) -> Any:
    return (spark.read.format(FORMAT).option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic)
            .options(**options).load())


@pytest.mark.spark
@pytest.mark.cluster
def test_reader_timestamp_and_partitioning_options_select_the_rows_spark_would(spark, kafka, make_topic) -> None:
    topic = make_topic(partitions=2)
    base = int(time.time() * 1000) - 3_600_000
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    # Three bands of 20 rows, 10 s apart in record time, spread over both partitions.
    stamp = {f"v{i}".encode(): base + (i // 20) * 10_000 for i in range(60)}
    for i, value in enumerate(stamp):
        producer.produce(topic, value, partition=i % 2, timestamp=stamp[value])
    assert producer.flush(30) == 0

    def values(df: Any) -> list[bytes]:
        return [r.value for r in df.select("value").collect()]

    def check(got: list[bytes], expected: list[bytes]) -> None:
        v = verdict(expected, got)
        assert (v.consumed, v.lost, v.duplicates) == (len(expected), 0, 0), v
        assert set(got) == set(expected)

    check(values(_load(spark, kafka.bootstrap_servers, topic, startingTimestamp=str(base + 10_000))),
          [v for v, ts in stamp.items() if ts >= base + 10_000])
    check(values(_load(spark, kafka.bootstrap_servers, topic, startingTimestamp=str(base),
                       endingTimestamp=str(base + 20_000))),
          [v for v, ts in stamp.items() if ts < base + 20_000])
    by_partition = json.dumps({topic: {"0": base + 20_000, "1": base + 5_000}})
    check(values(_load(spark, kafka.bootstrap_servers, topic, startingOffsetsByTimestamp=by_partition)),
          [v for i, (v, ts) in enumerate(stamp.items()) if ts >= (base + 20_000 if i % 2 == 0 else base + 5_000)])

    # A starting timestamp after every record: an error by default, the latest offset (nothing) on request.
    tomorrow = str(int(time.time() * 1000) + 86_400_000)
    with pytest.raises(Exception, match="startingOffsetsByTimestampStrategy"):
        _load(spark, kafka.bootstrap_servers, topic, startingTimestamp=tomorrow).count()
    assert _load(spark, kafka.bootstrap_servers, topic, startingTimestamp=tomorrow,
                 startingOffsetsByTimestampStrategy="latest").count() == 0

    split = _load(spark, kafka.bootstrap_servers, topic, minPartitions="6")
    assert split.rdd.getNumPartitions() == 6
    check(values(split), list(stamp))
    capped = _load(spark, kafka.bootstrap_servers, topic, maxRecordsPerPartition="7")
    assert capped.rdd.getNumPartitions() == 2 * 5  # 30 records per Kafka partition, at most 7 per task
    check(values(capped), list(stamp))


@pytest.mark.spark
@pytest.mark.cluster
def test_fail_on_data_loss_false_skips_deleted_records_and_true_fails(spark, kafka, make_topic) -> None:
    topic = make_topic(partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    for i in range(30):
        producer.produce(topic, f"d{i}".encode())
    assert producer.flush(30) == 0
    assert kafka.delete_records(topic, {0: 10}) == {0: 10}
    from_zero = json.dumps({topic: {"0": 0}})

    # Control: the deletion is real, and by default a read of it fails instead of skipping it.
    with pytest.raises(Exception, match="no longer in the log"):
        _load(spark, kafka.bootstrap_servers, topic, startingOffsets=from_zero).count()
    rows = _load(spark, kafka.bootstrap_servers, topic, startingOffsets=from_zero, failOnDataLoss="false").collect()
    assert sorted(r.offset for r in rows) == list(range(10, 30))


# A fresh Spark session that never calls register(): Spark's own lookup of installed pyspark_* modules must find
# format("reliable_kafka"). Run in its own interpreter: the suite's session has registered it by hand.
_WITHOUT_REGISTER = """
import json, os, re, sys
from pyspark.sql import SparkSession

bootstrap, topic = sys.argv[1], sys.argv[2]
spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.driver.memory", "512m").config("spark.sql.shuffle.partitions", "1").getOrCreate())
spark.sparkContext.setLogLevel("ERROR")
out = {}
df = spark.read.format("reliable_kafka").option("kafka.bootstrap.servers", bootstrap).option("subscribe", topic).load()
out["format"] = sorted(r.value.decode() for r in df.select("value").collect())
def error_class(exc):
    found = re.search(r"\\[([A-Z_.]+)\\]", str(exc))
    return found.group(1) if found else str(exc)[:300]

options = f"OPTIONS ('kafka.bootstrap.servers' '{bootstrap}', 'subscribe' '{topic}')"
spark.sql(f"CREATE TEMPORARY VIEW kafka_view USING reliable_kafka {options}")
out["sql_view"] = spark.sql("SELECT count(*) AS n FROM kafka_view").collect()[0].n
try:
    spark.sql(f"CREATE TABLE kafka_table USING reliable_kafka {options}")
    out["sql_table"] = spark.sql("SELECT count(*) AS n FROM kafka_table").collect()[0].n
except Exception as exc:
    out["sql_table"] = error_class(exc)
rows = spark.createDataFrame([("extra",)], "value string")
try:
    rows.write.format("reliable_kafka").option("kafka.bootstrap.servers", bootstrap).option("topic", topic).save()
    out["save"] = "written"
except Exception as exc:
    out["save"] = error_class(exc)
out["imported_by_the_driver"] = "reliable_kafka" in sys.modules
spark.stop()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.spark
@pytest.mark.cluster
def test_format_and_sql_work_without_register_in_a_fresh_session(kafka, make_topic, tmp_path) -> None:
    if importlib.util.find_spec("pyspark") is None or not shutil.which("java"):
        missing("pyspark and java", "pip install -e '.[spark]' and a Java 17+ runtime")
    topic = make_topic(partitions=1)
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers})
    values = [f"auto-{uuid.uuid4().hex[:8]}-{i}" for i in range(25)]
    for value in values:
        producer.produce(topic, value.encode())
    assert producer.flush(30) == 0
    # PYTHONPATH: this checkout (with pyspark_reliable_kafka.py at its top) for the driver and every Python worker.
    # JAVA_TOOL_OPTIONS: the JIT's first tier only, as for the suite's other JVMs (the job is small).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
           "JAVA_TOOL_OPTIONS": " ".join(QUICK_START_JVM_OPTIONS)}
    run = subprocess.run([sys.executable, "-c", _WITHOUT_REGISTER, kafka.bootstrap_servers, topic], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    got = json.loads(line[len("RESULT "):])
    assert got["format"] == sorted(values)
    assert got["sql_view"] == len(values)
    print("CREATE TABLE ... USING reliable_kafka, then SELECT:", got["sql_table"])  # see docs/spark.md
    # Spark refuses save() without mode("append") for every Python data source, before asking it (docs/spark.md).
    assert got["save"] == "UNSUPPORTED_DATA_SOURCE_SAVE_MODE"
    assert got["imported_by_the_driver"] is False, "the driver imported reliable_kafka: register() may have run"
