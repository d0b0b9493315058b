"""Where at_least_once's columns cost on Spark's own sink: rows/s, and the CPU per row of the Spark JVM (the
sink's Java producer runs in it) and of the three brokers, for the same rows written five ways:

* `value_only`: 100-byte values (the bench's `spark_kafka_sink_batched`);
* `value_130b`: 130-byte values, no header (the bytes of our rk-id header, without a header);
* `header_30b`: 100-byte values and a constant 30-byte `rk-id` header;
* `uuid_header`: 100-byte values and an `rk-id` header of Spark SQL's uuid() (36 bytes), the id a user
  would add by hand (not stable across a retried task, so it cannot make a retry's copies recognisable);
* `at_least_once`: what `write_kafka(..., guarantee="at_least_once")` hands the sink (spark/jvm_sink.py's
  `with_rk_columns`: the computed rk-id header, and the partition of each block of STICKY_ROWS rows,
  `(Spark partition + row // STICKY_ROWS) % n`: tasks running side by side write different partitions);
* `at_least_once_aligned`: the same header, the partition `(row // STICKY_ROWS) % n`: tasks running side
  by side write the same partition at about the same time, as the Java client's sticky partitioner has
  them do (what the placement costs the brokers in batches).

    python benchmarks/spark_sink_cpu.py [ROWS] [ROUNDS] [COMPRESSION] [VALUES] > out.json

COMPRESSION (default none) is every write's `kafka.compression.type`: with a codec the brokers validate a
batch by skipping each record's key, value and headers instead of reading them. VALUES is `padded`
(default: the row number left-padded with 'x' to 100 bytes, which a codec shrinks to almost nothing) or
`random` (bytes of SHA-512 digests of the row number, which no codec shrinks; the digests cost every
variant the same Spark CPU a row).

Each variant writes to a fresh 4-partition topic with the bench's batching (linger.ms=20,
batch.size=1000000); one unmeasured run of each, then ROUNDS interleaved rounds, the order reversed every
other round. CPU is read from /proc (utime + stime) of the Spark JVM (local[2]: driver and executor in one
process) and of each broker, before and after each write. A 3-node local cluster on the same host.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import uuid
from typing import Any

from _cluster import bench_cluster  # benchmarks/_cluster.py (scripts run from this directory)

from reliable_kafka.bench.common import round_order
from reliable_kafka.spark.writer import STICKY_ROWS

VARIANTS = ("value_only", "value_130b", "header_30b", "uuid_header", "at_least_once", "at_least_once_aligned")
WRITE_ID = "bench-0123456789ab"  # the bench's write ids are this long: rk-ids of ~27 bytes
_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115 - one read
    return (int(fields[11]) + int(fields[12])) / _TICKS


def main(rows: int, rounds: int, compression: str = "none", kind: str = "padded") -> dict[str, Any]:
    with bench_cluster() as (cluster, conn, create_topic):
        from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

        import reliable_kafka.spark.jvm_sink as jvm_sink
        from reliable_kafka.ids import ID_HEADER
        from reliable_kafka.spark.java_options import java_kafka_options
        from reliable_kafka.spark.local import local_session

        spark = local_session(app_name="spark-sink-cpu")
        jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())  # type: ignore[union-attr]
        brokers = [n.proc.pid for n in cluster.nodes.values() if n.proc is not None]

        def values(size: int) -> Any:
            if kind == "random":
                digests = "concat(unhex(sha2(cast(id as string), 512)), unhex(sha2(cast(-id - 1 as string), 512)), " \
                          "unhex(sha2(cast(id + 1000000000000 as string), 512)))"
                return spark.range(0, rows, 1, 4).select(F.expr(f"substring({digests}, 1, {size})").alias("value"))
            return spark.range(0, rows, 1, 4).select(
                F.expr(f"cast(lpad(cast(id as string), {size}, 'x') as binary)").alias("value"))

        df = values(100)
        header = F.array(F.struct(F.lit(ID_HEADER).alias("key"),
                                  F.lit(f"{WRITE_ID}:1:1234567890").cast("binary").alias("value")))
        uuid_header = F.array(F.struct(F.lit(ID_HEADER).alias("key"), F.expr("cast(uuid() as binary)").alias("value")))
        # with_rk_columns()'s rows with the partition of a block taken from the row alone.
        numbered = df.select("value", F.spark_partition_id().alias("_part"),
                             F.monotonically_increasing_id().bitwiseAND(F.lit((1 << 33) - 1)).alias("_row"))
        rk_id = F.concat(F.lit(f"{WRITE_ID}:"), F.col("_part").cast("string"), F.lit(":"),
                         F.col("_row").cast("string")).cast("binary")
        aligned = numbered.select(
            "value", F.array(F.struct(F.lit(ID_HEADER).alias("key"), rk_id.alias("value"))).alias("headers"),
            (F.floor(F.col("_row") / STICKY_ROWS) % 4).cast("int").alias("partition"))
        frames = {"value_only": df, "value_130b": values(130),
                  "header_30b": df.select("value", header.alias("headers")),
                  "uuid_header": df.select("value", uuid_header.alias("headers")),
                  "at_least_once": jvm_sink.with_rk_columns(df, WRITE_ID, 4),
                  "at_least_once_aligned": aligned}
        java = java_kafka_options(conn)

        def run(variant: str) -> dict[str, float]:
            topic = f"cpu-{uuid.uuid4().hex[:8]}"
            create_topic(topic, 4)
            spark_cpu, broker_cpu = _cpu_s(jvm_pid), sum(map(_cpu_s, brokers))
            start = time.perf_counter()
            (frames[variant].write.format("kafka").options(**java).option("kafka.linger.ms", "20")
             .option("kafka.batch.size", "1000000").option("kafka.compression.type", compression)
             .option("topic", topic).mode("append").save())
            seconds = time.perf_counter() - start
            return {"rows_per_s": round(rows / seconds),
                    "spark_jvm_cpu_us_per_row": round((_cpu_s(jvm_pid) - spark_cpu) / rows * 1e6, 3),
                    "brokers_cpu_us_per_row": round((sum(map(_cpu_s, brokers)) - broker_cpu) / rows * 1e6, 3)}

        for variant in VARIANTS:
            run(variant)
        runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for variant in round_order(VARIANTS, r):
                runs[variant].append(run(variant))
                print(variant, r, runs[variant][-1], file=sys.stderr, flush=True)
    base = [x["rows_per_s"] for x in runs["value_only"]]

    def median(variant: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[variant])

    return {
        "rows": rows, "rounds": rounds, "sticky_rows": STICKY_ROWS, "compression": compression, "values": kind,
        "variants": {
            v: {"rows_per_s": median(v, "rows_per_s"),
                "min": min(x["rows_per_s"] for x in r), "max": max(x["rows_per_s"] for x in r),
                "ratio_per_round": [round(x["rows_per_s"] / b, 3) for x, b in zip(r, base, strict=True)],
                "ratio_median": round(statistics.median(x["rows_per_s"] / b for x, b in zip(r, base, strict=True)), 3),
                "spark_jvm_cpu_us_per_row": median(v, "spark_jvm_cpu_us_per_row"),
                "brokers_cpu_us_per_row": median(v, "brokers_cpu_us_per_row"),
                "runs": r}
            for v, r in runs.items()
        },
    }


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    print(json.dumps(main(*(args + [3_000_000, 4][len(args):]), *sys.argv[3:5]), indent=1))
