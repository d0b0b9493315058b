"""Spark 4 finds `format("reliable_kafka")` here without register(spark): at the first data source lookup it
imports every installed top-level module named `pyspark_*` and registers its `DefaultSource`.

Without the spark extra (no pyarrow) this module defines no DefaultSource, so Spark's lookup of other
data sources is never broken by it; register(spark) then names what is missing.
"""

from __future__ import annotations

import logging

log = logging.getLogger("reliable_kafka.spark")

try:
    from reliable_kafka.spark.source import ReliableKafkaDataSource as DefaultSource
except ImportError as exc:  # pragma: no cover - depends on what is installed
    log.debug("reliable_kafka's Spark data source is not registered automatically: %s", exc)
else:
    __all__ = ["DefaultSource"]
