"""`reliable-kafka bench eos`: the at-least-once copier against TransactionalProcessor committing every
100 ms, in the same run on the same brokers, each copying the same seeded input in a process of its own.
The processor copies twice: with a Transform that returns an OutputRecord per record
(`transactional_processor`) and with a MapValues (`transactional_processor_map_values`, the values as they
are: the same value, key and one rk-id header per record as the copier writes).

Only the copy is measured: the input is seeded first, and the clock runs from a variant's first commit
to the commit that covers the last record, so process start and the group join are left out of both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Message

from reliable_kafka.admin import admin_client
from reliable_kafka.bench.common import peak_rss_mb, round_order, rows_against, run_child
from reliable_kafka.bench.worker import produce_raw
from reliable_kafka.lab.eos_copier_bounce import AtLeastOnceCopier, copy_transform
from reliable_kafka.testing.child_connection import Connection, connection_from_env
from reliable_kafka.transactions import CommitInfo, MapValues, TransactionalProcessor

BASELINE = "at_least_once_copier"
VARIANT = "transactional_processor"
MAP_VALUES = "transactional_processor_map_values"
PARTITIONS = 3
WARM_UP_RECORDS = 200_000


def run_eos_bench(
    connection: Connection,
    messages: int = 200_000,
    create_topic: Callable[[str, int], None] | None = None,
    *,
    repeat: int = 3,
) -> list[dict[str, Any]]:
    """Rows of `reliable-kafka bench --json` for the baseline (ratio 1.0) and TransactionalProcessor's two.

    `create_topic(name, partitions)` (required) makes the topics. After an unmeasured copy by each (of
    at most WARM_UP_RECORDS records), each variant copies the input `repeat` times, interleaved with
    the others so that a slow spell of a shared host hits both, and its median counts: on a busy host one
    lucky run would otherwise decide the ratio.
    """
    if create_topic is None:
        raise TypeError("run_eos_bench() needs create_topic(name, partitions)")
    source = f"bench-eos-in-{uuid.uuid4().hex[:6]}"
    create_topic(source, PARTITIONS)
    # A fast raw idempotent producer, not measured. The records carry rk-ids, as ReliableProducer's do,
    # so both copiers carry the same headers across and the difference is the transactions.
    produce_raw(connection, source, messages, with_ids=True)
    runs: dict[str, list[dict[str, Any]]] = {BASELINE: [], VARIANT: [], MAP_VALUES: []}
    # An unmeasured copy by each variant first: the brokers' transactional paths (the coordinator, the
    # markers) run cold the first time: in 600k-record probes the first round's processor made the
    # brokers spend 20-26 s of CPU against 7-14 s in later rounds, which decided that round's ratio.
    for variant in runs:
        output = f"bench-eos-warm-{variant}-{uuid.uuid4().hex[:6]}"
        create_topic(output, PARTITIONS)
        _in_own_process(variant, connection, source, output, min(messages, WARM_UP_RECORDS))
    drop = _topic_dropper(connection)
    for round_no in range(repeat):
        for variant in round_order(list(runs), round_no):
            results = runs[variant]
            output = f"bench-eos-{variant}-{uuid.uuid4().hex[:6]}"
            create_topic(output, PARTITIONS)
            results.append(_in_own_process(variant, connection, source, output, messages))
            # Nothing reads a copy again. Kept, each 5M-record copy held about 2.4 GB of the brokers' disk
            # (replication 3), and a run's nine copies once filled the development host's disk and
            # stopped its brokers mid-run.
            drop(output)
    return [row.as_json() for row in rows_against("eos", BASELINE, runs, messages)]


def _topic_dropper(connection: Connection) -> Callable[[str], None]:
    admin = admin_client(connection["bootstrap.servers"], connection)

    def drop(topic: str) -> None:
        admin.delete_topics([topic])[topic].result(timeout=60)

    return drop


def _in_own_process(variant: str, connection: Connection, source: str, output: str, messages: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", __name__, variant, "--input", source, "--output", output, "--messages", str(messages)]
    return run_child(argv, connection, f"eos benchmark {variant}")


def copy_rate(variant: str, connection: Connection, source: str, output: str, messages: int,
              processor_options: dict[str, Any] | None = None) -> float:
    """Copy `messages` records with one variant; records per second between its first and last commit.

    `processor_options`: more TransactionalProcessor arguments for the processor variants (the probes in
    benchmarks/ vary its settings with the same copy and the same clock)."""
    group = f"bench-eos-{variant}-{uuid.uuid4().hex[:6]}"
    marks: list[tuple[float, int]] = []
    copier: AtLeastOnceCopier | TransactionalProcessor

    def on_commit(info: CommitInfo) -> None:
        total = (marks[-1][1] if marks else 0) + info.messages
        marks.append((time.perf_counter(), total))
        if total >= messages:
            copier.stop()

    if variant == BASELINE:
        copier = AtLeastOnceCopier(connection, group_id=group, input_topic=source, output_topic=output,
                                   on_commit=on_commit)
        copier.run()
        copier.close()
    elif variant in (VARIANT, MAP_VALUES):
        copier = TransactionalProcessor(
            {**connection, "group.id": group}, input_topics=[source],
            transform=copy_transform(output) if variant == VARIANT else MapValues(output, Message.value),
            transactional_id=f"{group}-0", max_batch_interval_s=0.1, on_commit=on_commit,
            **(processor_options or {}),
        )
        with copier:
            copier.run()
    else:
        raise ValueError(f"unknown eos variant {variant!r}; use {BASELINE}, {VARIANT} or {MAP_VALUES}")
    if not marks:
        raise RuntimeError(f"{variant} committed nothing of {messages} records")
    (first_at, first_total), (last_at, last_total) = marks[0], marks[-1]
    if last_total < messages:
        raise RuntimeError(f"{variant} copied {last_total} of {messages} records in {len(marks)} commit(s)")
    if last_at <= first_at:
        # The clock runs from the first commit to the last (joining the group and the first fetch are not
        # the copy's speed), so a copy that fits in one commit has nothing to time.
        raise RuntimeError(f"{variant} copied all {messages} records in one commit, so there is no time between "
                           "commits to measure: use more --messages (eos needs several commits; at least 100,000)")
    return (last_total - first_total) / (last_at - first_at)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="one eos benchmark variant; prints its result as JSON")
    ap.add_argument("variant", choices=[BASELINE, VARIANT, MAP_VALUES])
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--messages", type=int, required=True)
    a = ap.parse_args(argv)
    rate = copy_rate(a.variant, connection_from_env(), a.input, a.output, a.messages)
    print(json.dumps({"msgs_per_s": rate, "peak_rss_mb": peak_rss_mb()}), flush=True)
    # A lingering librdkafka thread must not keep the benchmark waiting.
    threading.Event().wait(0.1)
    os._exit(0)


if __name__ == "__main__":
    main()
