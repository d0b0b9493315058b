"""PySpark connector: a Kafka sink, at_least_once with stable rk-ids or exactly_once, and a read_committed source.

Use df.write.format("reliable_kafka") / spark.read.format("reliable_kafka") after register(spark), or
the plain functions write_kafka() and read_kafka(); docs/spark.md says what each guarantee promises.
"""

from reliable_kafka.extras import needs_extra

with needs_extra("spark", "the Spark connector (reliable_kafka.spark)"):
    from reliable_kafka.spark.api import KafkaBatch, WriteResult, read_kafka, read_manifest, register, write_kafka
    from reliable_kafka.spark.markers import Manifest, PartitionMarker
    from reliable_kafka.spark.options import AT_LEAST_ONCE, DEFAULT_MARKER_TOPIC, EXACTLY_ONCE
    from reliable_kafka.spark.source import FORMAT, ReliableKafkaDataSource

__all__ = [
    "AT_LEAST_ONCE",
    "DEFAULT_MARKER_TOPIC",
    "EXACTLY_ONCE",
    "FORMAT",
    "KafkaBatch",
    "Manifest",
    "PartitionMarker",
    "ReliableKafkaDataSource",
    "WriteResult",
    "read_kafka",
    "read_manifest",
    "register",
    "write_kafka",
]
