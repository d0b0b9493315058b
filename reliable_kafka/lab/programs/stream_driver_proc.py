"""A Spark Structured Streaming driver that the lab SIGKILLs: Kafka (input topic) -> Kafka (output topic).

One process holds one local Spark session (its JVM and Python workers are its children) and runs one
streaming query whose offsets live in --checkpoint, so a driver started again on the same checkpoint goes
on where the killed one was, and replays the micro-batch the killed one had planned but not committed.

--mode control: Spark's own Kafka source and sink (format("kafka"), the Java client): at-least-once.
--mode reliable: reliable_kafka's source (read_committed) and sink (guarantee=exactly_once).

Each micro-batch takes at most --max-offsets-per-trigger input offsets. Without --available-now the query
runs micro-batches back to back until the process is killed, or --max-seconds pass (exit 5, so a driver
the lab lost track of does not run forever); with it, the query reads what the input held when it started,
prints one JSON line (the query id and how many rows it read) and exits 0. With --stop-file the query
stops once that file exists and no input is waiting, prints the same line and exits 0. Exit 4: the query
failed. The connection settings come in the environment (see testing.child_connection), or --bootstrap alone.

--master spark://... runs the query's tasks on a standalone cluster (testing.spark_cluster) instead of a
local session; the package ships in --py-files. --slow-seconds-per-batch makes every task pass each Arrow
batch of 250 records on that long after the last (spark.faults.slow_attempts), in both modes, so a task
is caught mid-write.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from reliable_kafka.testing.child_connection import connection_from_env

log = logging.getLogger("reliable_kafka.lab.stream_driver")

CONTROL_MODE = "control"
RELIABLE_MODE = "reliable"
# The JIT's first tier only, as the suite's other JVMs run (QUICK_START_JVM_OPTIONS): a driver the lab
# restarts four times pays its start-up four times, and a micro-batch of a thousand records needs no C2.
DRIVER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1"
EXIT_FAILED, EXIT_OUT_OF_TIME = 4, 5


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The driver's arguments; refuses (exit 2) a query that would read its own output or never end."""
    ap = argparse.ArgumentParser(prog="python -m reliable_kafka.lab.programs.stream_driver_proc",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--mode", choices=[CONTROL_MODE, RELIABLE_MODE], required=True)
    ap.add_argument("--bootstrap", help="the brokers of an open cluster (default: from the environment)")
    ap.add_argument("--input", required=True, help="the topic the query reads")
    ap.add_argument("--output", required=True, help="the topic the query writes")
    ap.add_argument("--checkpoint", required=True, help="the query's checkpointLocation (a directory)")
    ap.add_argument("--max-offsets-per-trigger", type=int, default=1_000)
    ap.add_argument("--available-now", action="store_true",
                    help="read what the input holds now, then exit 0 (Trigger.AvailableNow)")
    ap.add_argument("--max-seconds", type=float, default=600.0,
                    help="stop the query and exit 5 after this long, whatever the trigger")
    ap.add_argument("--stop-file", help="stop the query (exit 0) once this file exists and no input waits")
    ap.add_argument("--master", help="a standalone cluster's spark://host:port (default: a local session)")
    ap.add_argument("--py-files", help="with --master: the package zip the executors import it from")
    ap.add_argument("--slow-seconds-per-batch", type=float, default=0.0,
                    help="every task waits this long before passing each Arrow batch on")
    args = ap.parse_args(argv)
    if args.input == args.output:
        ap.error(f"--input and --output are both {args.input!r}: the query would read what it wrote, forever")
    if args.max_offsets_per_trigger < 1:
        ap.error(f"--max-offsets-per-trigger must be >= 1, got {args.max_offsets_per_trigger}")
    if not args.max_seconds > 0:
        ap.error(f"--max-seconds must be > 0, got {args.max_seconds}")
    if bool(args.master) != bool(args.py_files):
        ap.error("--master and --py-files go together: the cluster's executors import the package from the zip")
    if args.slow_seconds_per_batch < 0:
        ap.error(f"--slow-seconds-per-batch must be >= 0, got {args.slow_seconds_per_batch}")
    if args.stop_file and args.available_now:
        ap.error("--stop-file and --available-now are two ways to end the query: give one")
    return args


def _slowed(df: Any, args: argparse.Namespace) -> Any:
    if not args.slow_seconds_per_batch:
        return df
    from reliable_kafka.spark.faults import Slow, slow_attempts

    return slow_attempts(df, Slow(args.slow_seconds_per_batch, attempts=None))


def _session(args: argparse.Namespace) -> Any:
    """A local session, or a driver of the standalone cluster at --master; Spark's own Kafka connector on
    the classpath for the control."""
    # A SIGKILLed JVM runs no shutdown hook, so the temp directories it made stay behind: they go where
    # TMPDIR says (the lab gives each driver its work directory), not to /tmp.
    tmpdir = tempfile.gettempdir()
    control = args.mode == CONTROL_MODE
    # 250 records an Arrow batch: with values of a few hundred bytes a batch is more than the 64 KB in which
    # a Python worker's output passes on, so a slowed task's writer gets its batches while they are made.
    conf = {"spark.sql.execution.arrow.maxRecordsPerBatch": "250"} if args.slow_seconds_per_batch else {}
    if args.master is None:
        from reliable_kafka.spark.local import local_session

        conf["spark.driver.extraJavaOptions"] = f'{DRIVER_JAVA_OPTIONS} -Djava.io.tmpdir="{tmpdir}"'
        return local_session(app_name=f"reliable-kafka-lab-stream-{args.mode}", with_kafka_connector=control,
                             conf=conf)
    import os

    from pyspark.sql import SparkSession

    from reliable_kafka.spark.api import register
    from reliable_kafka.spark.jars import spark_kafka_jars
    from reliable_kafka.testing.spark_cluster import driver_conf

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # a path every node of this machine has
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    conf.update(driver_conf(args.master, args.py_files, jvm_options=[DRIVER_JAVA_OPTIONS], tmpdir=tmpdir))
    if control:
        conf["spark.jars"] = ",".join(str(j) for j in spark_kafka_jars())
    builder = SparkSession.builder.appName(f"reliable-kafka-lab-stream-{args.mode}")
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def _await(query: Any, args: argparse.Namespace) -> bool:
    """Whether the query ended (or was stopped by --stop-file) within --max-seconds."""
    if not args.stop_file:
        return bool(query.awaitTermination(args.max_seconds))
    import os
    import time

    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        if query.awaitTermination(0.5):
            return True
        status = query.status
        if os.path.exists(args.stop_file) and not status["isDataAvailable"] and not status["isTriggerActive"]:
            log.info("stop file %s found with no input waiting: stopping the query", args.stop_file)
            query.stop()
            return True
    return False


def _query(spark: Any, args: argparse.Namespace, connection: dict[str, Any]) -> Any:
    """The streaming query, started: the input's key and value, into the output topic."""
    limit = str(args.max_offsets_per_trigger)
    if args.mode == CONTROL_MODE:
        from reliable_kafka.spark.java_options import java_kafka_options

        java = java_kafka_options(connection)
        # startingOffsets applies to the first run only; a restart goes on from the checkpoint.
        source = (spark.readStream.format("kafka").options(**java).option("subscribe", args.input)
                  .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", limit).load())
        sink = _slowed(source.select("key", "value"), args).writeStream.format("kafka").options(**java)
    else:
        from reliable_kafka.spark import FORMAT

        # The librdkafka connection as the connector's kafka.* options: a secured cluster's login too.
        ours = {f"kafka.{k}": str(v) for k, v in connection.items()}
        source = (spark.readStream.format(FORMAT).options(**ours).option("subscribe", args.input)
                  .option("startingOffsets", "earliest").option("maxOffsetsPerTrigger", limit).load())
        sink = (_slowed(source.select("key", "value"), args).writeStream.format(FORMAT).options(**ours)
                .option("guarantee", "exactly_once"))
    sink = sink.option("topic", args.output).option("checkpointLocation", args.checkpoint)
    sink = sink.trigger(availableNow=True) if args.available_now else sink.trigger(processingTime="0 seconds")
    return sink.start()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d stream-driver %(levelname)s %(name)s: %(message)s")
    connection = connection_from_env(args.bootstrap)
    spark = _session(args)
    try:
        query = _query(spark, args, connection)
        log.info("%s query %s started (run %s) on %s -> %s, checkpoint %s, %s", args.mode, query.id, query.runId,
                 args.input, args.output, args.checkpoint,
                 "available now" if args.available_now else "micro-batches until killed")
        finished = _await(query, args)
        if not finished:
            log.warning("the query ran out of its %.0fs; stopping it", args.max_seconds)
            query.stop()
            return EXIT_OUT_OF_TIME
        if query.exception() is not None:
            log.error("the query failed: %s", query.exception())
            return EXIT_FAILED
        rows = sum(int(p.get("numInputRows", 0)) for p in query.recentProgress)
        batches = sorted({int(p["batchId"]) for p in query.recentProgress if p.get("numInputRows", 0) > 0})
        print(json.dumps({"query_id": str(query.id), "rows": rows, "batches": batches}), flush=True)
        return 0
    except Exception:
        log.exception("the stream driver failed")
        return EXIT_FAILED
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
