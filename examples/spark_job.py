"""A Spark batch job that publishes a day's invoices to Kafka exactly once, then reads them back.

Guarantees shown here (see docs/guarantees.md and docs/spark.md):

* `guarantee="exactly_once"` with a stable `write_id` (one per logical batch, e.g. per day): each
  Spark partition writes through its own transactional producer; a task that fails halfway is
  retried by Spark and its first attempt's records are aborted, so `read_committed` readers see
  every invoice exactly once. Spark's own Kafka sink writes the retried rows twice.
* Re-running the whole job with the same `write_id` (a scheduler retry, an operator's second click)
  writes nothing: the write's manifest is already there.
* The reader pins its offset ranges when called, reads `read_committed`, and commits the consumer
  group only when the `with` block finished without an error: a failed job reads the same records
  next time, never skips them.

Try it (it starts a small local Spark session; Java 17 and `pip install 'reliable-kafka[spark]'`):

    python examples/spark_job.py --bootstrap-servers B --create-topic --invoices 5000

`--fail-first-attempt-after N` makes the first attempt of every write task fail after N rows, the way a
lost executor does. The job prints one JSON line: what it wrote, what the re-run wrote, what it read.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from reliable_kafka.spark import read_kafka, write_kafka
from reliable_kafka.spark.local import local_session

log = logging.getLogger("spark_job")


def invoices(spark: SparkSession, count: int, day: str, partitions: int) -> DataFrame:
    """The day's invoices: key = customer (one customer's invoices keep their order), value = JSON."""
    ids = spark.range(count, numPartitions=partitions)
    return ids.select(
        F.concat(F.lit("cust-"), (F.col("id") % 97).cast("string")).alias("key"),
        F.to_json(F.struct(
            F.concat(F.lit(f"inv-{day}-"), F.col("id").cast("string")).alias("invoice_id"),
            ((F.col("id") * 37) % 10_000 + 100).alias("amount_cents"),
        )).alias("value"),
    )


def log_end(bootstrap_servers: str, topic: str) -> int:
    """The sum of the topic's end offsets: any record a writer adds, committed or not, moves it."""
    consumer = Consumer({"bootstrap.servers": bootstrap_servers, "group.id": "rk-example-probe"})
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10, cached=False)[1]
                   for p in parts)
    finally:
        consumer.close()


def create_topic(bootstrap_servers: str, topic: str, partitions: int = 3) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    if topic not in admin.list_topics(timeout=10).topics:
        new = NewTopic(topic, num_partitions=partitions, replication_factor=3, config={"min.insync.replicas": "2"})
        admin.create_topics([new])[topic].result(timeout=30)
        log.info("created topic %s", topic)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--topic", default="invoices")
    ap.add_argument("--day", default="2026-01-31", help="the batch: its write id is invoices-<day>")
    ap.add_argument("--invoices", type=int, default=5_000)
    ap.add_argument("--partitions", type=int, default=4, help="Spark partitions of the job")
    ap.add_argument("--group", default="invoice-audit", help="consumer group of the read-back")
    ap.add_argument("--fail-first-attempt-after", type=int, default=None,
                    help="fault injection: the first attempt of every write task fails after N rows")
    ap.add_argument("--create-topic", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.create_topic:
        create_topic(args.bootstrap_servers, args.topic)

    # local[2,4]: up to 4 attempts per task, as on a cluster. On a real cluster use your own session
    # and call reliable_kafka.spark.register(spark) once.
    spark = local_session(app_name="invoice-publisher", with_kafka_connector=False)
    try:
        df = invoices(spark, args.invoices, args.day, args.partitions)
        write_id = f"invoices-{args.day}"
        options: dict[str, int] = {}
        if args.fail_first_attempt_after is not None:
            options["test.failFirstAttemptAfterRows"] = args.fail_first_attempt_after
        first = write_kafka(df, args.bootstrap_servers, args.topic, guarantee="exactly_once", write_id=write_id,
                            num_partitions=args.partitions, options=options)
        # The scheduler runs the job again (it did not see it finish, say): nothing is written twice.
        before = log_end(args.bootstrap_servers, args.topic)
        write_kafka(df, args.bootstrap_servers, args.topic, guarantee="exactly_once", write_id=write_id,
                    num_partitions=args.partitions)
        rerun_records = log_end(args.bootstrap_servers, args.topic) - before

        with read_kafka(spark, args.bootstrap_servers, subscribe=args.topic, group_id=args.group) as batch:
            rows = batch.df.select(F.get_json_object(F.col("value").cast("string"), "$.invoice_id").alias("id"))
            seen = Counter(r["id"] for r in rows.collect())
        # The with block ended without an error: the group's offsets are committed now.
        result = {
            "write_id": write_id,
            "written": first.manifest.rows if first.manifest else None,
            "rerun_records": rerun_records,  # records (and transaction markers) the re-run added: 0
            "read": sum(seen.values()),
            "distinct": len(seen),
            "duplicates": sum(n - 1 for n in seen.values()),
            "committed": batch.committed,
        }
    finally:
        spark.stop()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
