"""write_kafka's at_least_once through Spark's own Kafka sink (spark/jvm_sink.py): the records the Python writer
writes, rk-id, Kafka partition and headers alike, and a clear refusal where it could not give the same result.
(Its retries under task failures: test_writer_faults.py, at_least_once upstream_failure.)"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from reliable_kafka.errors import ConfigError, WriteRefused
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.spark import write_kafka
from tests.spark.jobs import read_back

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

ROWS = 15_000  # three Spark partitions of 5,000: a partition's unkeyed rows span two blocks of STICKY_ROWS


def _mixed_frame(spark: Any, tag: str) -> Any:
    """Unique values; every third row keyed, every fifth with a header of its own."""
    return spark.range(0, ROWS, 1, 3).select(
        F.when(F.col("id") % 3 == 0, F.concat(F.lit("k"), (F.col("id") % 7).cast("string"))).alias("key"),
        F.concat(F.lit(f"{tag}-"), F.lpad(F.col("id").cast("string"), 8, "0")).cast("binary").alias("value"),
        F.when(F.col("id") % 5 == 0, F.array(F.struct(F.lit("origin").alias("key"),
                                                      F.lit(b"app").alias("value")))).alias("headers"),
    )


def _records(bootstrap: str, topic: str) -> dict[bytes, tuple[int, list[tuple[str, bytes]]]]:
    out: dict[bytes, tuple[int, list[tuple[str, bytes]]]] = {}
    for m in read_back(bootstrap, topic):
        assert m.value() not in out, f"{m.value()!r} written twice"
        out[m.value()] = (m.partition(), list(m.headers() or []))
    return out


def test_the_jvm_sink_writes_what_the_python_writer_does(spark, kafka_connector, kafka, make_topic) -> None:
    write_id = f"jvm-{uuid.uuid4().hex[:8]}"
    df = _mixed_frame(spark, write_id)
    through = {}
    for path in ("jvm", "python"):
        topic = make_topic(partitions=3)
        result = write_kafka(df, kafka.bootstrap_servers, topic, guarantee="at_least_once", write_id=write_id,
                             write_path=path)
        assert (result.path, result.write_id) == (path, write_id)
        through[path] = _records(kafka.bootstrap_servers, topic)
    jvm, python = through["jvm"], through["python"]
    assert len(jvm) == ROWS
    # Record by record: the same Kafka partition (sticky blocks for unkeyed rows, murmur2 for keys) and
    # the same headers, the row's own first and its rk-id `<write id>:<Spark partition>:<row>` last.
    assert jvm == python
    rk_ids = {value: dict(headers)[ID_HEADER] for value, (_, headers) in jvm.items()}
    assert rk_ids[f"{write_id}-00000000".encode()] == f"{write_id}:0:0".encode()
    assert rk_ids[f"{write_id}-00014999".encode()] == f"{write_id}:2:4999".encode()
    assert jvm[f"{write_id}-00000005".encode()][1] == [("origin", b"app"), (ID_HEADER, f"{write_id}:0:5".encode())]
    # Every partition of the topic got rows: the sticky rule spread the unkeyed ones.
    assert {p for p, _ in jvm.values()} == {0, 1, 2}


@pytest.mark.parametrize(("change", "said"), [
    ({"guarantee": "exactly_once"}, "exactly_once writes through transactions"),
    ({"options": {"kafka.message.timeout.ms": "60000"}}, "kafka.message.timeout.ms has no same-named setting"),
    ({"topic": None}, "the rows name their topics"),
])
def test_write_path_jvm_refuses_what_it_cannot_write_alike(spark, kafka_connector, kafka, change, said) -> None:
    df = spark.range(3).select(F.lit("t").alias("topic"), F.col("id").cast("string").alias("value"))
    args: dict[str, Any] = {"topic": "jvm-refused", "guarantee": "at_least_once", "write_id": "refused",
                            "num_partitions": 1, **change}
    with pytest.raises(ConfigError, match=said) as refused:
        write_kafka(df, kafka.bootstrap_servers, write_path="jvm", **args)
    assert refused.value.key == "write_path" and "write_path='auto' or 'python'" in str(refused.value)
    with pytest.raises(ConfigError, match="'fast' is not one of auto, jvm, python"):
        write_kafka(df, kafka.bootstrap_servers, "jvm-refused", write_path="fast")


def test_a_missing_topic_is_refused_on_the_driver_before_any_row_is_sent(spark, kafka_connector, kafka) -> None:
    df = spark.range(3).select(F.col("id").cast("string").alias("value"))
    topic = f"jvm-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(WriteRefused, match=f"topic '{topic}' does not exist: create it before writing"):
        write_kafka(df, kafka.bootstrap_servers, topic, guarantee="at_least_once", write_path="jvm")
