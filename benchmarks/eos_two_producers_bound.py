"""The bound of an exactly-once copy whose records never wait for a commit: two transactional producers
taking turns, against the at-least-once copier and TransactionalProcessor, on one cluster.

    python benchmarks/eos_two_producers_bound.py [--out PATH] MESSAGES ROUNDS

TransactionalProcessor has one transactional producer, and a producer cannot write while it commits, so
what it processes during a commit waits in a backlog and is written the moment the commit ends; then the
next commit flushes that burst (benchmarks/eos_cpu.py: 96-97 % of its consume() calls are made during a
commit). Here the loop writes into producer A's transaction for 100 ms, hands A's commit (its offsets,
then commit_transaction) to a thread, and goes on writing into producer B's transaction at once; B's
commit starts only after A's returned, so a transaction's offsets are never committed before the
transaction ahead of it. It is a bound, not a processor: no rebalance handling, retries, dead letters,
failure recovery or stop, and each producer's transactional id is fixed. The copy and the clock are as in
`bench eos` (records per second between the first and the last commit; each variant in a process of its
own; one unmeasured copy of up to 200,000 records each first). Written to PATH (default
benchmarks/results/eos/two-producers-bound.json).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _cluster import eos_copies, out_path, seeded_eos_cluster  # benchmarks/_cluster.py (run from this directory)
from confluent_kafka import Consumer, Producer, TopicPartition

from reliable_kafka.bench import eos
from reliable_kafka.bench.common import run_child
from reliable_kafka.config import consumer_config, transactional_producer_config
from reliable_kafka.testing.child_connection import connection_from_env

OUT = Path(__file__).resolve().parent / "results" / "eos" / "two-producers-bound.json"
BOUNDS = {"one_producer_bound": 1, "two_producers_bound": 2}
INTERVAL_S = 0.1  # as the processor's max_batch_interval_s in bench eos


def _commit(producer: Producer, offsets: dict[tuple[str, int], int], metadata: Any, records: int) -> int:
    producer.send_offsets_to_transaction([TopicPartition(t, p, o) for (t, p), o in offsets.items()], metadata, 30)
    producer.commit_transaction(30)
    return records


def bound_rate(source: str, output: str, n: int, producers_used: int) -> float:
    """Copy n records with a bare loop into transactions of `producers_used` (1 or 2) producers taking turns.

    With one, the records consumed while its commit runs wait in a backlog, written into the next
    transaction when the commit returned, as TransactionalProcessor does; with two, they go into the other
    producer's transaction at once."""
    connection = connection_from_env()
    group = f"bench-eos-bound-{uuid.uuid4().hex[:6]}"
    consumer = Consumer(consumer_config({**connection, "group.id": group}))
    producers = [Producer(transactional_producer_config(connection, f"{group}-{i}")) for i in range(producers_used)]
    for producer in producers:
        producer.init_transactions(30)
    consumer.subscribe([source])
    committer = ThreadPoolExecutor(1)
    marks: list[tuple[float, int]] = []
    committing: Future[int] | None = None
    active, records = 0, 0
    offsets: dict[tuple[str, int], int] = {}
    backlog: list[tuple[Any, Any, Any]] = []  # (value, key, headers) consumed while the only producer commits
    producers[active].begin_transaction()
    opened = time.monotonic()

    def reap(future: Future[int]) -> None:
        marks.append((time.perf_counter(), (marks[-1][1] if marks else 0) + future.result()))

    while not marks or marks[-1][1] < n:
        msgs = consumer.consume(num_messages=500, timeout=0.1)
        if producers_used == 1 and committing is not None and committing.done():
            reap(committing)
            committing = None
            producers[0].begin_transaction()
            for value, key, headers in backlog:
                producers[0].produce(output, value, key, -1, None, None, 0, headers)
            backlog = []
        produce = producers[active].produce
        for msg in msgs:
            if msg.error() is not None:
                continue
            if committing is None or producers_used == 2:
                produce(output, msg.value(), msg.key(), -1, None, None, 0, msg.headers())
            else:
                if not backlog:
                    opened = time.monotonic()  # the next transaction's interval counts from its first record
                backlog.append((msg.value(), msg.key(), msg.headers()))
            offsets[(msg.topic(), msg.partition())] = msg.offset() + 1  # type: ignore[index,operator]
            records += 1
        producers[active].poll(0)
        due = records and time.monotonic() - opened >= INTERVAL_S
        if due and producers_used == 2:
            if committing is not None:
                reap(committing)  # the transaction ahead commits first
            committing = committer.submit(_commit, producers[active], offsets, consumer.consumer_group_metadata(),
                                          records)
            active, offsets, records = 1 - active, {}, 0
            producers[active].begin_transaction()
            opened = time.monotonic()
        elif due and committing is None:  # one producer: its commit, once the one before it returned
            committing = committer.submit(_commit, producers[0], offsets, consumer.consumer_group_metadata(), records)
            offsets, records = {}, 0
        elif producers_used == 2 and committing is not None and committing.done():
            reap(committing)
            committing = None
    (first_at, first_total), (last_at, last_total) = marks[0], marks[-1]
    return (last_total - first_total) / (last_at - first_at)


def child(source: str, output: str, n: int, producers_used: int) -> None:
    rate = bound_rate(source, output, n, producers_used)
    print(json.dumps({"msgs_per_s": rate, "peak_rss_mb": 0.0}), flush=True)
    threading.Event().wait(0.1)
    os._exit(0)  # the second transaction left open and librdkafka's threads must not keep the run waiting


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], int(argv[3]), int(argv[4]))
        return
    path, argv = out_path(argv, OUT)
    n, rounds = int(argv[0]), int(argv[1])
    runs: dict[str, list[float]] = {eos.BASELINE: [], eos.VARIANT: [], **{bound: [] for bound in BOUNDS}}
    with seeded_eos_cluster("eos-bound", n) as (conn, create, source):
        for measured, variant, output, copy in eos_copies(create, "eos-bound", runs, n, rounds):
            if variant in BOUNDS:
                argv_child = [sys.executable, __file__, "--child", source, output, str(copy), str(BOUNDS[variant])]
                result = run_child(argv_child, conn, variant)
            else:
                result = eos._in_own_process(variant, conn, source, output, copy)
            if measured:  # the first copy of each only warms the brokers up
                runs[variant].append(result["msgs_per_s"])
                print(f"{variant}: {result['msgs_per_s']:,.0f} records/s", flush=True)
    base = runs[eos.BASELINE]
    ratios = {v: [rate / b for rate, b in zip(rates, base, strict=True)] for v, rates in runs.items()}
    for variant, rates in runs.items():
        print(f"{variant}: median {statistics.median(rates):,.0f} records/s, ratio per round "
              f"{', '.join(f'{x:.2f}' for x in ratios[variant])}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"messages": n, "rounds": rounds, "interval_s": INTERVAL_S, "runs": runs,
                                    "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
