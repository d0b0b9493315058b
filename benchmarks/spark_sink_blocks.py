"""How many rows at_least_once sends to one Kafka partition before moving to the next (the writer's
STICKY_ROWS) against what that costs on Spark's own sink: the same rows and rk-id header, the partition of
each block of B rows taken as with_rk_columns() takes it, `(Spark partition + row // B) % n`, for several B,
beside the value alone and the header without a partition column (the Java client's sticky partitioner).

    python benchmarks/spark_sink_blocks.py [ROWS] [ROUNDS] [B,B,...] > out.json

Each variant writes the same DataFrame (100-byte values, 4 Spark partitions) to a fresh 4-partition topic
with the bench's batching (linger.ms=20, batch.size=1000000); one unmeasured run of each, then ROUNDS
interleaved rounds, the order reversed every other round. A 3-node local cluster, local[2] Spark.
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

WRITE_ID = "bench-0123456789ab"  # the bench's write ids are this long: rk-ids of ~27 bytes


def main(rows: int, rounds: int, blocks: list[int]) -> dict[str, Any]:
    variants = ["value_only", "header_no_partition"] + [f"block_{b}" for b in blocks]
    with bench_cluster() as (_cluster, conn, create_topic):
        from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

        from reliable_kafka.spark.java_options import java_kafka_options
        from reliable_kafka.spark.jvm_sink import with_rk_columns
        from reliable_kafka.spark.local import local_session

        spark = local_session(app_name="spark-sink-blocks")
        df = spark.range(0, rows, 1, 4).select(
            F.expr("cast(lpad(cast(id as string), 100, 'x') as binary)").alias("value"))
        frames = {"value_only": df,
                  "header_no_partition": with_rk_columns(df, WRITE_ID, 4).select("value", "headers")}
        for b in blocks:
            frames[f"block_{b}"] = with_rk_columns(df, WRITE_ID, 4, block_rows=b)
        java = java_kafka_options(conn)

        def run(variant: str) -> float:
            topic = f"blocks-{uuid.uuid4().hex[:8]}"
            create_topic(topic, 4)
            start = time.perf_counter()
            (frames[variant].write.format("kafka").options(**java).option("kafka.linger.ms", "20")
             .option("kafka.batch.size", "1000000").option("topic", topic).mode("append").save())
            return rows / (time.perf_counter() - start)

        for variant in variants:
            run(variant)
        runs: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(rounds):
            for variant in round_order(variants, r):
                runs[variant].append(run(variant))
                print(variant, r, round(runs[variant][-1]), file=sys.stderr, flush=True)
    base = runs["value_only"]
    return {
        "rows": rows, "rounds": rounds,
        "variants": {
            v: {"rows_per_s": round(statistics.median(r)), "min": round(min(r)), "max": round(max(r)),
                "ratio_per_round": [round(x / b, 3) for x, b in zip(r, base, strict=True)],
                "ratio_median": round(statistics.median(x / b for x, b in zip(r, base, strict=True)), 3),
                "runs": [round(x) for x in r]}
            for v, r in runs.items()
        },
    }


if __name__ == "__main__":
    rows_arg = int(sys.argv[1]) if len(sys.argv) > 1 else 3_000_000
    rounds_arg = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    blocks_arg = [int(b) for b in sys.argv[3].split(",")] if len(sys.argv) > 3 else [4096, 16384, 65536]
    print(json.dumps(main(rows_arg, rounds_arg, blocks_arg), indent=1))
