"""TransactionalProcessor's per-record loop on its own: which consumed records it processes, and the positions
and offsets it hands over, with a stand-in checkpoint that keeps every batch it is given.

The loop keeps a partition's ownership and position per run of that partition's records (consume() hands
them out in runs) and writes them back when the run ends or a batch is handed over mid-run; these tests pin
what that must never change: records of partitions not owned, or before the position, are skipped, and
every batch's offsets are the next offset after its own last record of each partition. A MapValues takes a
path of its own through the loop: the same tests run through it, and its outputs, retries and dead letters
are held to those of the Transform it stands for.
"""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Message

from reliable_kafka import telemetry
from reliable_kafka.errors import ConfigError
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.transactions import MapValues, Outcome, OutputRecord, TransactionalProcessor, Transform
from reliable_kafka.transactions import processor as processor_module
from reliable_kafka.transactions.records import OUT_DEAD, OUT_INPUT, OUT_INPUT_OFFSET, OUT_TOPIC, Batch, each_out

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _untraced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop as it runs without an OpenTelemetry SDK: a tracer provider another test of the session
    installed would otherwise wrap every transform in a span (and a MapValues's in the general path)."""
    monkeypatch.setattr(telemetry, "tracing_enabled", lambda: False)


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
               slow_at: int | None = None, kind: str = "transform") -> TransactionalProcessor:
    def value(msg: Message) -> bytes | None:
        processed.append((msg.partition(), msg.offset()))  # type: ignore[arg-type]
        if clock is not None and len(processed) == slow_at:
            clock.now = 2.0  # this record took long: the check after it is due
        return msg.value()

    def transform(msg: Message) -> tuple[OutputRecord]:
        return (OutputRecord("out", value(msg), msg.key(), msg.headers()),)

    return _looping(checkpoint, transform if kind == "transform" else MapValues("out", value))


def _looping(checkpoint: _Checkpoint, transform: Transform, **options: Any) -> TransactionalProcessor:
    processor = TransactionalProcessor({"bootstrap.servers": "127.0.0.1:1", "group.id": "loop"},
                                       input_topics=["in"], transform=transform, transactional_id="loop", **options)
    processor._checkpoint = checkpoint  # type: ignore[assignment]  # the loop alone, as benchmarks/eos_loop.py
    return processor


def _run(partition: int, offsets: range) -> list[Message]:
    return [Message(topic="in", partition=partition, offset=o, value=b"v%d" % o,
                    headers=[("rk-id", b"id-%d-%d" % (partition, o))]) for o in offsets]


KINDS = pytest.mark.parametrize("kind", ["transform", "map_values"])


@KINDS
def test_records_of_partitions_not_owned_or_before_the_position_are_skipped_and_each_run_moves_its_position(
        kind: str) -> None:
    checkpoint = _Checkpoint(owned={("in", 0), ("in", 1)}, positions={("in", 1): 12})
    processed: list[tuple[int, int]] = []
    msgs = [*_run(0, range(0, 3)), *_run(2, range(0, 2)), *_run(1, range(10, 14)), *_run(0, range(3, 5))]

    assert _processor(checkpoint, processed, kind=kind)._process_batch(msgs) is Outcome.DONE

    # Partition 2 is not owned; partition 1's records before its position (a rewind's, say) are stale; the
    # second run of partition 0 goes on from where its first ended.
    assert processed == [(0, 0), (0, 1), (0, 2), (1, 12), (1, 13), (0, 3), (0, 4)]
    [batch] = checkpoint.batches
    assert batch.messages == 7
    assert batch.offsets == {("in", 0): 5, ("in", 1): 14}
    assert checkpoint.positions == {("in", 0): 5, ("in", 1): 14}
    assert [(o[OUT_INPUT], o[OUT_INPUT_OFFSET]) for o in each_out(batch.outputs)] == [
        (("in", p), o) for p, o in processed]


@KINDS
def test_a_record_consumed_twice_in_one_batch_is_processed_once(kind: str) -> None:
    checkpoint = _Checkpoint(owned={("in", 0)}, positions={})
    processed: list[tuple[int, int]] = []
    msgs = [*_run(0, range(0, 3)), *_run(0, range(1, 4))]  # a run that starts over at offset 1

    _processor(checkpoint, processed, kind=kind)._process_batch(msgs)

    assert processed == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert checkpoint.batches[0].offsets == {("in", 0): 4}


@KINDS
@pytest.mark.parametrize("deadline_after", [1, 2, 3, 5])
def test_a_batch_handed_over_mid_run_carries_the_offsets_of_its_own_records(
        deadline_after: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = _Checkpoint(owned={("in", 0), ("in", 1)}, positions={}, next_check=1.0)
    processed: list[tuple[int, int]] = []
    msgs = [*_run(0, range(0, 3)), *_run(1, range(0, 3))]
    clock = _Clock()
    monkeypatch.setattr(processor_module, "time", clock)

    _processor(checkpoint, processed, clock, slow_at=deadline_after, kind=kind)._process_batch(msgs)

    first, second = checkpoint.batches
    assert first.messages == deadline_after and second.messages == 6 - deadline_after
    expected: list[dict[Any, int]] = [{}, {}]
    for i, (partition, offset) in enumerate(processed):
        expected[0 if i < deadline_after else 1][("in", partition)] = offset + 1
    assert [first.offsets, second.offsets] == expected
    assert checkpoint.positions == {("in", 0): 3, ("in", 1): 3}


# ---- MapValues: the same outputs as the Transform it stands for ------------------------------------------


def _inputs() -> list[Message]:
    """Inputs with an rk-id, with none (a foreign producer's: coordinates stand in), with two (the last one
    counts, as ids.header_value reads it), with other headers too, and with a key."""
    return [
        Message(topic="in", partition=0, offset=0, value=b"a", headers=[("rk-id", b"id-a")]),
        Message(topic="in", partition=0, offset=1, value=b"b"),
        Message(topic="in", partition=0, offset=2, value=b"c", headers=[("rk-id", b"old"), ("rk-id", b"new")]),
        Message(topic="in", partition=0, offset=3, value=b"d", key=b"k", headers=[("x", b"1"), ("rk-id", b"id-d")]),
    ]


def _outputs(transform: Transform, msgs: list[Message], **options: Any) -> tuple[list[Any], Batch]:
    checkpoint = _Checkpoint(owned={("in", 0)}, positions={})
    _looping(checkpoint, transform, **options)._process_batch(msgs)
    [batch] = checkpoint.batches
    return list(each_out(batch.outputs)), batch


def _upper(msg: Message) -> bytes:
    return msg.value().upper()  # type: ignore[union-attr]


def test_map_values_writes_what_the_transform_it_stands_for_writes_with_the_same_rk_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def transform(msg: Message) -> tuple[OutputRecord]:
        return (OutputRecord("out", _upper(msg), msg.key()),)

    general, _ = _outputs(transform, _inputs())
    # The loop's own path for a MapValues, not the MapValues called as a Transform.
    monkeypatch.setattr(MapValues, "__call__", lambda self, msg: pytest.fail("called as a Transform"))
    mapped, mapped_batch = _outputs(MapValues("out", _upper), _inputs())

    assert mapped == general
    # The rk-id is the header produce() gets: bytes, "<input rk-id>:0", or the coordinates' for a foreign input.
    assert [(o[1], o[2], o[4]) for o in mapped] == [
        (b"A", None, b"id-a:0"), (b"B", None, b"in/0/1:0"), (b"C", None, b"new:0"), (b"D", b"k", b"id-d:0")]
    assert mapped_batch.messages == 4 and mapped_batch.offsets == {("in", 0): 4}


def test_map_values_called_as_a_transform_returns_one_output_record_or_none() -> None:
    msg = _inputs()[3]
    assert tuple(MapValues("out", _upper)(msg)) == (OutputRecord("out", b"D", b"k"),)
    assert tuple(MapValues("out", lambda m: None)(msg)) == ()


def test_map_values_returning_none_writes_nothing_and_still_moves_the_offset() -> None:
    outputs, batch = _outputs(MapValues("out", lambda m: None if m.offset() % 2 else m.value()), _inputs())

    assert [(o[OUT_INPUT_OFFSET], o[1]) for o in outputs] == [(0, b"a"), (2, b"c")]
    assert batch.messages == 4 and batch.offsets == {("in", 0): 4}


def test_a_failing_map_values_is_retried_then_dead_lettered_like_a_transform() -> None:
    calls: dict[int, int] = {}

    def flaky(msg: Message) -> bytes:
        offset: int = msg.offset()  # type: ignore[assignment]
        calls[offset] = calls.get(offset, 0) + 1
        if offset == 1 or (offset == 2 and calls[offset] == 1):
            raise ValueError(f"cannot map {offset}")  # 1: every time (poison); 2: the first time only
        return _upper(msg)

    outputs, batch = _outputs(MapValues("out", flaky), _inputs(),
                              retry=RetryPolicy(attempts=3, initial_backoff_s=0, max_backoff_s=0))

    assert calls == {0: 1, 1: 3, 2: 2, 3: 1}
    assert [(o[OUT_TOPIC], o[1], o[4], o[OUT_DEAD]) for o in outputs if not o[OUT_DEAD]] == [
        ("out", b"A", b"id-a:0", False), ("out", b"C", b"new:0", False), ("out", b"D", b"id-d:0", False)]
    [dead] = [o for o in outputs if o[OUT_DEAD]]
    assert (dead[OUT_TOPIC], dead[1], dead[OUT_INPUT_OFFSET]) == ("in.dlq", b"b", 1)
    assert batch.messages == 4 and batch.dead == 1 and batch.offsets == {("in", 0): 4}


def test_map_values_with_a_value_serializer_encodes_its_values() -> None:
    def encode(value: Any) -> bytes:
        return b"<%s>" % str(value).encode()

    outputs, _ = _outputs(MapValues("out", lambda m: m.offset()), _inputs()[:2], value_serializer=encode)

    assert [(o[1], o[4]) for o in outputs] == [(b"<0>", b"id-a:0"), (b"<1>", b"in/0/1:0")]


@pytest.mark.parametrize(("topic", "fn", "key"), [
    ("", _upper, "MapValues.topic"),
    (None, _upper, "MapValues.topic"),
    ("out", b"not a function", "MapValues.fn"),
])
def test_a_map_values_without_a_topic_or_a_function_is_refused_when_made(topic: Any, fn: Any, key: str) -> None:
    with pytest.raises(ConfigError) as refused:
        MapValues(topic, fn)
    assert refused.value.key == key
