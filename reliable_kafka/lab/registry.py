"""Every lab scenario by name, in the order the lab runs them.

Scenarios that need an optional part (pyspark) are listed only when that part imports.
"""

from __future__ import annotations

import importlib
import logging

from reliable_kafka.lab.base import Scenario

log = logging.getLogger(__name__)

# module, attribute: a Scenario or a list of them
_SOURCES = [
    ("reliable_kafka.lab.producer_scenarios", "SCENARIOS"),
    ("reliable_kafka.lab.consumer_crash", "SCENARIO"),
    ("reliable_kafka.lab.service_crash", "SCENARIO"),
    ("reliable_kafka.lab.eos_copier_bounce", "SCENARIO"),
    ("reliable_kafka.lab.spark_task_retry", "SCENARIO"),
    ("reliable_kafka.lab.spark_stream_driver_kill", "SCENARIO"),
    ("reliable_kafka.lab.spark_stream_executor_kill", "SCENARIO"),
]


def scenarios() -> dict[str, Scenario]:
    found: dict[str, Scenario] = {}
    for module, attr in _SOURCES:
        try:
            value = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            if exc.name in ("pyspark", "pyarrow", "pandas"):  # optional extra not installed
                log.info("lab scenarios of %s need the spark extra: %s", module, exc)
                continue
            raise
        for s in value if isinstance(value, list) else [value]:
            found[s.name] = s
    return found
