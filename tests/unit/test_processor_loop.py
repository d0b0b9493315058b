"""TransactionalProcessor's per-record loop on its own: which consumed records it processes, and the positions
and offsets it hands over, with a stand-in checkpoint that keeps every batch it is given.

The loop keeps a partition's ownership and position per run of that partition's records (consume() hands
them out in runs) and writes them back when the run ends or a batch is handed over mid-run; these tests pin
what that must never change: records of partitions not owned, or before the position, are skipped, and
every batch's offsets are the next offset after its own last record of each partition.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Message

from reliable_kafka.transactions import Outcome, OutputRecord, TransactionalProcessor
from reliable_kafka.transactions import processor as processor_module
from reliable_kafka.transactions.records import OUT_INPUT, OUT_INPUT_OFFSET, Batch, each_out

pytestmark = pytest.mark.timeout(30)


class _Clock:
    """time.monotonic() for the processor module: the transforms move it on."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


class _Checkpoint:
    """What _process_batch reads of the checkpoint; add() keeps each batch. With `next_check` at t=1, a
    transform that moves the clock past it (a slow one, say) makes the loop hand the batch so far over."""

    def __init__(self, owned: set[tuple[str, int]], positions: dict[tuple[str, int], int],
                 next_check: float = float("inf")) -> None:
        self.owned, self.positions = owned, positions
        self.batches: list[Batch] = []
        self.next_check = next_check

    def add(self, batch: Batch) -> Outcome:
        self.batches.append(batch)
        self.next_check = float("inf")
        return Outcome.DONE


def _processor(checkpoint: _Checkpoint, processed: list[tuple[int, int]], clock: _Clock | None = None,
               slow_at: int | None = None) -> TransactionalProcessor:
    def transform(msg: Message) -> tuple[OutputRecord]:
        processed.append((msg.partition(), msg.offset()))  # type: ignore[arg-type]
        if clock is not None and len(processed) == slow_at:
            clock.now = 2.0  # this record took long: the check after it is due
        return (OutputRecord("out", msg.value(), msg.key(), msg.headers()),)

    processor = TransactionalProcessor({"bootstrap.servers": "127.0.0.1:1", "group.id": "loop"},
                                       input_topics=["in"], transform=transform, transactional_id="loop")
    processor._checkpoint = checkpoint  # type: ignore[assignment]  # the loop alone, as benchmarks/eos_loop.py
    return processor


def _run(partition: int, offsets: range) -> list[Message]:
    return [Message(topic="in", partition=partition, offset=o, value=b"v%d" % o,
                    headers=[("rk-id", b"id-%d-%d" % (partition, o))]) for o in offsets]


def test_records_of_partitions_not_owned_or_before_the_position_are_skipped_and_each_run_moves_its_position() -> None:
    checkpoint = _Checkpoint(owned={("in", 0), ("in", 1)}, positions={("in", 1): 12})
    processed: list[tuple[int, int]] = []
    msgs = [*_run(0, range(0, 3)), *_run(2, range(0, 2)), *_run(1, range(10, 14)), *_run(0, range(3, 5))]

    assert _processor(checkpoint, processed)._process_batch(msgs) is Outcome.DONE

    # Partition 2 is not owned; partition 1's records before its position (a rewind's, say) are stale; the
    # second run of partition 0 goes on from where its first ended.
    assert processed == [(0, 0), (0, 1), (0, 2), (1, 12), (1, 13), (0, 3), (0, 4)]
    [batch] = checkpoint.batches
    assert batch.messages == 7
    assert batch.offsets == {("in", 0): 5, ("in", 1): 14}
    assert checkpoint.positions == {("in", 0): 5, ("in", 1): 14}
    assert [(o[OUT_INPUT], o[OUT_INPUT_OFFSET]) for o in each_out(batch.outputs)] == [
        (("in", p), o) for p, o in processed]


def test_a_record_consumed_twice_in_one_batch_is_processed_once() -> None:
    checkpoint = _Checkpoint(owned={("in", 0)}, positions={})
    processed: list[tuple[int, int]] = []
    msgs = [*_run(0, range(0, 3)), *_run(0, range(1, 4))]  # a run that starts over at offset 1

    _processor(checkpoint, processed)._process_batch(msgs)

    assert processed == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert checkpoint.batches[0].offsets == {("in", 0): 4}


@pytest.mark.parametrize("deadline_after", [1, 2, 3, 5])
def test_a_batch_handed_over_mid_run_carries_the_offsets_of_its_own_records(
        deadline_after: int, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = _Checkpoint(owned={("in", 0), ("in", 1)}, positions={}, next_check=1.0)
    processed: list[tuple[int, int]] = []
    msgs = [*_run(0, range(0, 3)), *_run(1, range(0, 3))]
    clock = _Clock()
    monkeypatch.setattr(processor_module, "time", clock)

    _processor(checkpoint, processed, clock, slow_at=deadline_after)._process_batch(msgs)

    first, second = checkpoint.batches
    assert first.messages == deadline_after and second.messages == 6 - deadline_after
    expected: list[dict[Any, int]] = [{}, {}]
    for i, (partition, offset) in enumerate(processed):
        expected[0 if i < deadline_after else 1][("in", partition)] = offset + 1
    assert [first.offsets, second.offsets] == expected
    assert checkpoint.positions == {("in", 0): 3, ("in", 1): 3}
