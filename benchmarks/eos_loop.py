"""The exactly-once processor's per-record loop alone: µs per record and the garbage collector's share.

    python benchmarks/eos_loop.py [--records N] [--rounds R] [--transform copy|plain|map]

No brokers: TransactionalProcessor._process_batch runs over consumed-like records made in memory (100-byte
values with an rk-id header, batches of 500 from three partitions in turn, as consume() hands them out),
with the copy transform of the eos benchmark (or, with `--transform plain`, one whose OutputRecords carry no
headers and so get their rk-id from the input's; with `--transform map`, a MapValues that writes each value
as it is). Its checkpoint is replaced by a stand-in that holds the
batches' outputs as a transaction does until it is written (`--held` records, default 10,000: 100 ms at
100k records/s) and then drops them, so nothing is produced and no transaction runs: what is left is the
loop that decides, per record, ownership, position, the transform's outputs and their rk-ids, and what
the held outputs cost the garbage collector. Prints one JSON line: the median µs per record over the
rounds, and every round's figure with the young and full collections it ran. To compare two versions,
run it from each checkout.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

from confluent_kafka import Message

from reliable_kafka.lab.eos_copier_bounce import copy_transform
from reliable_kafka.transactions import MapValues, OutputRecord, TransactionalProcessor, Transform, records
from reliable_kafka.transactions.checkpoint import Outcome
from reliable_kafka.transactions.records import Batch

BATCH = 500  # what the processor asks consume() for at a time
PARTITIONS = 3


class _Checkpoint:
    """What _process_batch reads of the checkpoint; add() holds the outputs, `held` records at a time."""

    def __init__(self, held: int) -> None:
        self.owned = {("in", p) for p in range(PARTITIONS)}
        self.positions: dict[tuple[str, int], int] = {}
        self.next_check = float("inf")  # no deadline passes inside a batch
        self.held, self.records, self.outputs = held, 0, 0
        self.batches: list[Batch] = []
        # Items per output in Batch.outputs: one tuple each in versions before the flat layout.
        self.width = getattr(records, "OUT_WIDTH", 1)

    def add(self, batch: Batch) -> Outcome:
        self.batches.append(batch)
        self.records += batch.messages
        self.outputs += len(batch.outputs) // self.width
        if self.records >= self.held:  # "written": the transaction's records go
            self.batches, self.records = [], 0
        return Outcome.DONE


def _batches(records: int) -> list[list[Message]]:
    out, offset = [], 0
    for n in range(records // BATCH):
        partition = n % PARTITIONS
        out.append([Message(topic="in", partition=partition, offset=offset + i, value=b"v" * 100,
                            headers=[("rk-id", b"%032x-%d" % (n, i))]) for i in range(BATCH)])
        offset += BATCH
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--held", type=int, default=10_000)
    ap.add_argument("--transform", choices=["copy", "plain", "map"], default="copy",
                    help="copy: the eos benchmark's copy transform (an OutputRecord per record, the input's "
                         "headers); plain: an OutputRecord with the value and key only (the output gets its "
                         "rk-id from the input's); map: a MapValues writing each value as it is")
    a = ap.parse_args()
    transforms: dict[str, Transform] = {
        "copy": copy_transform("out"),
        "plain": lambda msg: (OutputRecord("out", msg.value(), msg.key()),),
        "map": MapValues("out", Message.value),
    }
    transform = transforms[a.transform]
    processor = TransactionalProcessor({"bootstrap.servers": "127.0.0.1:1", "group.id": "bench-eos-loop"},
                                       input_topics=["in"], transform=transform, transactional_id="bench-eos-loop")
    checkpoint = _Checkpoint(a.held)
    processor._checkpoint = checkpoint  # type: ignore[assignment]  # the loop alone, see the docstring
    batches = _batches(a.records)
    rounds: list[dict[str, Any]] = []
    for _ in range(a.rounds):
        checkpoint.positions.clear()
        checkpoint.outputs = 0
        before = [s["collections"] for s in gc.get_stats()]
        start = time.perf_counter()
        for batch in batches:
            processor._process_batch(batch)
        elapsed = time.perf_counter() - start
        after = [s["collections"] for s in gc.get_stats()]
        rounds.append({"us_per_record": round(elapsed / (len(batches) * BATCH) * 1e6, 3), "outputs": checkpoint.outputs,
                       "young_collections": after[0] - before[0], "full_collections": after[2] - before[2]})
    print(json.dumps({"transform": a.transform, "records": len(batches) * BATCH, "held": a.held,
                      "us_per_record": statistics.median(r["us_per_record"] for r in rounds), "rounds": rounds}))


if __name__ == "__main__":
    main()
