"""`bench spark`'s exactly_once row on two versions of the code, each against Spark's own sink in the same
Spark session, on one cluster.

    python benchmarks/spark_before_after.py ROWS ROUNDS CHILDREN OUT.json BEFORE_DIR

BEFORE_DIR holds the older `reliable_kafka` package (`git archive <commit> reliable_kafka | tar -x -C
BEFORE_DIR`); the newer one is this checkout. CHILDREN child processes per version run one after the other,
alternating (before, after, after, before, ...); a child starts a local Spark session (local[2], as the
bench) importing its version, writes a small warm-up and then one unmeasured full write with each variant
(class loading and JIT, as the bench's rounds after its first), then ROUNDS interleaved rounds of the bench's
DataFrame (ROWS rows of 100 bytes, 4 Spark partitions, a fresh 4-partition topic per write) with Spark's sink
at our writer's batching (`spark_kafka_sink_batched`, the target's baseline) and `exactly_once`. A ratio is
taken within a round: both writes ran in the same session, one after the other.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

HERE = str(Path(__file__).resolve().parent.parent)
VARIANTS = ("spark_kafka_sink_batched", "exactly_once")


def child(bootstrap: str, rows: int, rounds: int) -> dict[str, list[float]]:
    from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

    import reliable_kafka
    from reliable_kafka.bench.spark import OUR_WRITER_BATCHING
    from reliable_kafka.cli.bench import _create_topic_fn
    from reliable_kafka.spark.api import write_kafka
    from reliable_kafka.spark.local import local_session

    print(f"child: reliable_kafka from {reliable_kafka.__file__}", file=sys.stderr, flush=True)
    create_topic = _create_topic_fn({"bootstrap.servers": bootstrap})  # the bench's: waits for every leader

    def fresh_topic() -> str:
        name = f"ab-{uuid.uuid4().hex[:10]}"
        create_topic(name, 4)
        return name

    spark = local_session(app_name="spark-before-after")
    df = spark.range(0, rows, 1, 4).select(F.expr("cast(lpad(cast(id as string), 100, 'x') as binary)").alias("value"))

    def write(variant: str, frame: Any) -> float:
        topic = fresh_topic()
        start = time.perf_counter()
        if variant == "exactly_once":
            write_kafka(frame, bootstrap, topic, guarantee="exactly_once", write_id=f"ab-{uuid.uuid4().hex[:12]}",
                        num_partitions=4)
        else:
            (frame.write.format("kafka").option("kafka.bootstrap.servers", bootstrap).options(**OUR_WRITER_BATCHING)
             .option("topic", topic).mode("append").save())
        return time.perf_counter() - start

    try:
        warm = df.limit(4000).repartition(4)
        for variant in VARIANTS:
            write(variant, warm)
            write(variant, df)
        runs: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for r in range(rounds):
            for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
                runs[variant].append(rows / write(variant, df))
        return runs
    finally:
        spark.stop()


def main() -> None:
    rows, rounds, children = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, before = Path(sys.argv[4]), sys.argv[5]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cluster import bench_cluster  # benchmarks/_cluster.py

    code = {"before": before, "after": HERE}
    ratios: dict[str, list[float]] = {"before": [], "after": []}
    runs: dict[str, list[dict[str, list[float]]]] = {"before": [], "after": []}
    with bench_cluster() as (_cluster, conn, _create):
        load_before = os.getloadavg()
        for c in range(children):
            for version in ("before", "after") if c % 2 == 0 else ("after", "before"):
                env = {**os.environ, "PYTHONPATH": code[version]}
                done = subprocess.run(
                    [sys.executable, __file__, "--child", conn["bootstrap.servers"], str(rows), str(rounds)],
                    env=env, check=True, capture_output=True, text=True, cwd=code[version],
                )
                result = json.loads(done.stdout.strip().splitlines()[-1])
                runs[version].append(result)
                got = [e / b for e, b in zip(result["exactly_once"], result["spark_kafka_sink_batched"], strict=True)]
                ratios[version] += got
                print(f"child {c + 1} {version}: baseline {[round(x) for x in result['spark_kafka_sink_batched']]} "
                      f"rows/s, exactly_once {[round(x) for x in result['exactly_once']]} rows/s, "
                      f"ratios {[round(x, 2) for x in got]}", flush=True)
        load_after = os.getloadavg()
    summary = {}
    for version, rs in runs.items():
        every = {v: [x for r in rs for x in r[v]] for v in VARIANTS}
        summary[version] = {
            **{f"{v}_rows_per_s_median": statistics.median(every[v]) for v in VARIANTS},
            "ratio_median": round(statistics.median(ratios[version]), 3),
            "ratio_min": round(min(ratios[version]), 3), "ratio_max": round(max(ratios[version]), 3),
            "ratios": [round(x, 3) for x in ratios[version]], "children": rs,
        }
        print(f"{version}: exactly_once / baseline median {summary[version]['ratio_median']:.2f} "
              f"[{summary[version]['ratio_min']:.2f}-{summary[version]['ratio_max']:.2f}]", flush=True)
    out.write_text(json.dumps({"rows": rows, "rounds_per_child": rounds, "children_per_version": children,
                               "cores": os.cpu_count(), "load_before": load_before, "load_after": load_after,
                               "versions": summary}, indent=2))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
