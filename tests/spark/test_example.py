"""examples/spark_job.py, run as a user runs it (its own Spark session), against the real cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from reliable_kafka.testing import LocalKafkaCluster, consume_all
from reliable_kafka.testing.cluster import QUICK_START_JVM_OPTIONS

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]


def test_spark_job_publishes_each_invoice_once_through_failed_task_attempts(kafka: LocalKafkaCluster) -> None:
    topic = f"invoices-{uuid.uuid4().hex[:8]}"
    count, partitions, fail_after = 2_000, 4, 150
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "spark_job.py"), "--bootstrap-servers", kafka.bootstrap_servers,
         "--topic", topic, "--create-topic", "--invoices", str(count), "--partitions", str(partitions),
         "--day", "2026-02-01", "--fail-first-attempt-after", str(fail_after)],
        # The JIT's first tier only, as for the suite's other JVMs (QUICK_START_JVM_OPTIONS): the job is small.
        env={**os.environ, "JAVA_TOOL_OPTIONS": " ".join(QUICK_START_JVM_OPTIONS)},
        cwd=ROOT, capture_output=True, text=True, timeout=400, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result == {"write_id": "invoices-2026-02-01", "written": count, "rerun_records": 0, "read": count,
                      "distinct": count, "duplicates": 0, "committed": True}

    # An independent read_committed reader agrees ...
    ids = Counter(json.loads(m.value())["invoice_id"] for m in consume_all(kafka.bootstrap_servers, topic))
    assert sorted(ids) == sorted(f"inv-2026-02-01-{i}" for i in range(count)) and set(ids.values()) == {1}
    # ... while the failed first attempts did leave their rows in the log, aborted: the fault bit.
    raw = sum(1 for _ in consume_all(kafka.bootstrap_servers, topic, isolation_level="read_uncommitted"))
    assert raw == count + partitions * fail_after
