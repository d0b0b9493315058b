"""What each column our at_least_once hands Spark's own Kafka sink costs: the same rows written value only
(the bench's `spark_kafka_sink_batched`), with our partition column, with a constant 30-byte rk-id header,
with a 1-byte one, and by `write_kafka(..., guarantee="at_least_once")` itself (computed header + partition).

    python benchmarks/spark_sink_columns.py [ROWS] [ROUNDS] > out.json

Every variant writes the same DataFrame (100-byte values, 4 Spark partitions) to a fresh 4-partition topic
with the bench's batching (linger.ms=20, batch.size=1000000); one unmeasured run of each first, then
ROUNDS interleaved rounds (the order reversed every other round). A 3-node local cluster, local[2] Spark.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import uuid
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.bench.common import round_order

VARIANTS = ("value_only", "partition", "header_30b", "header_1b", "at_least_once")
WRITE_ID = "bench-0123456789ab"  # the bench's write ids are this long: rk-ids of ~27 bytes


def main(rows: int, rounds: int) -> dict[str, Any]:
    with bench_cluster() as (_cluster, conn, create_topic):
        from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

        from reliable_kafka.ids import ID_HEADER
        from reliable_kafka.spark.api import write_kafka
        from reliable_kafka.spark.java_options import java_kafka_options
        from reliable_kafka.spark.jvm_sink import with_rk_columns
        from reliable_kafka.spark.local import local_session

        spark = local_session(app_name="spark-sink-columns")
        df = spark.range(0, rows, 1, 4).select(
            F.expr("cast(lpad(cast(id as string), 100, 'x') as binary)").alias("value"))

        def header(value: str) -> Any:
            return F.array(F.struct(F.lit(ID_HEADER).alias("key"), F.lit(value).cast("binary").alias("value")))

        frames = {
            "value_only": df,
            "partition": with_rk_columns(df, WRITE_ID, 4).select("value", "partition"),
            "header_30b": df.select("value", header(f"{WRITE_ID}:1:1234567").alias("headers")),
            "header_1b": df.select("value", header("1").alias("headers")),
        }
        java = java_kafka_options(conn)

        def run(variant: str) -> float:
            topic = f"cols-{uuid.uuid4().hex[:8]}"
            create_topic(topic, 4)
            start = time.perf_counter()
            if variant == "at_least_once":
                write_kafka(df, conn["bootstrap.servers"], topic, guarantee="at_least_once",
                            write_id=f"{WRITE_ID[:-4]}{uuid.uuid4().hex[:4]}", num_partitions=4)
            else:
                (frames[variant].write.format("kafka").options(**java).option("kafka.linger.ms", "20")
                 .option("kafka.batch.size", "1000000").option("topic", topic).mode("append").save())
            return time.perf_counter() - start

        for variant in VARIANTS:
            run(variant)
        runs: dict[str, list[int]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for variant in round_order(VARIANTS, r):
                runs[variant].append(round(rows / run(variant)))
                print(variant, r, runs[variant][-1], file=sys.stderr, flush=True)
    base = runs["value_only"]
    return {
        "rows": rows, "rounds": rounds,
        "variants": {
            v: {"rows_per_s": statistics.median(r), "min": min(r), "max": max(r), "runs": r,
                "ratio_per_round": [round(x / b, 3) for x, b in zip(r, base, strict=True)],
                "ratio_median": round(statistics.median(x / b for x, b in zip(r, base, strict=True)), 3)}
            for v, r in runs.items()
        },
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(json.dumps(main(*(args + [3_000_000, 3][len(args):])), indent=2))
