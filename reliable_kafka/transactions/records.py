"""What a transaction carries: the transform's OutputRecords (or a MapValues's values), flattened to plain
fields, in Batches.

Guarantee: every output gets a deterministic rk-id from its input, and a processed record's outputs are
held as plain fields of one list, nothing the garbage collector tracks per record, however long they wait
behind a commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, cast

from confluent_kafka import KafkaError, KafkaException, Message

from reliable_kafka.errors import ConfigError
from reliable_kafka.ids import ID_HEADER

TopicPartitionKey = tuple[str, int]
HeaderValue = str | bytes | None
OutputHeaders = Sequence[tuple[str, HeaderValue]] | Mapping[str, HeaderValue]


@dataclass(slots=True)
class OutputRecord:
    """A record `transform` wants written, in the same transaction as the input that produced it.

    Without an `rk-id` header of its own it gets a deterministic one, "<input rk-id>:<index>" (or
    "<topic>/<partition>/<offset>:<index>" for an input without rk-id), so a downstream dedup can
    recognise it whatever happens upstream. `value` and `key` are bytes (or None), or any object the
    processor's value_serializer / key_serializer turns into bytes.
    """

    topic: str
    value: bytes | None | Any
    key: bytes | None | Any = None
    headers: OutputHeaders | None = None
    partition: int | None = None


Transform = Callable[[Message], Iterable[OutputRecord]]
Outputs = Sequence[OutputRecord]


@dataclass(frozen=True, slots=True)
class MapValues:
    """A transform with one output per input at most: `fn(msg)`'s value, under the input's key, to `topic`.

    `fn` returns the output's value (bytes, or an object the processor's value_serializer encodes), or None
    for no output (a tombstone needs a Transform that returns an OutputRecord). The output gets the rk-id
    "<input rk-id>:0" and no other headers, exactly as `OutputRecord(topic, fn(msg), msg.key())` from a
    Transform would: a MapValues is such a Transform (it can be called as one), and it fails, retries and
    is dead-lettered as one.

    Without (de)serializers and tracing the processor also takes a path of its own for it: the value goes
    straight into the batch, with no OutputRecord per record and none of the checks a Transform's outputs
    need. The loop alone (benchmarks/eos_loop.py): 0.47 µs a record against 0.70 for the eos benchmark's
    copy Transform and 0.85 for one returning OutputRecord(topic, value, key); on the cluster, 0.15-0.2 µs
    less CPU a record in the loop's thread (benchmarks/eos_cpu.py), too little to show in the copy's rate.
    """

    topic: str
    fn: Callable[[Message], Any]

    def __post_init__(self) -> None:
        # Refused when made: found at the first record, it would dead-letter every input instead.
        if not isinstance(self.topic, str) or not self.topic.strip():
            raise ConfigError("MapValues.topic", f"must be the output topic's name, got {self.topic!r}")
        if not callable(self.fn):
            raise ConfigError("MapValues.fn", f"must be a function of the consumed Message that returns the "
                                              f"output's value, got {type(self.fn).__name__}")

    def __call__(self, msg: Message) -> tuple[OutputRecord, ...]:
        value = self.fn(msg)
        return () if value is None else (OutputRecord(self.topic, value, msg.key()),)


# One output, ready for produce(): its fields in a fixed order, held in a Batch as OUT_WIDTH consecutive
# items of one flat list (see Batch) and handed to code outside the hot loops as a plain tuple. Headers
# are kept as a tuple of pairs, or as the rk-id's value alone (a str for an output without headers of its
# own, bytes for one whose only header is an rk-id given to it), and made a list (what produce() takes)
# only when written.
OutHeaders: TypeAlias = "str | bytes | tuple[tuple[str, HeaderValue], ...]"
Out = tuple[str, "bytes | None", "bytes | None", int, OutHeaders, TopicPartitionKey, int, bool]
# Its positions: where it goes (topic, value, key, partition with -1 for the partitioner's choice,
# headers), then the input it came from (partition, offset) and whether it is a dead-letter copy.
# The per-record loops write and unpack the fields positionally in this order (an unpack is cheaper
# than indexing by name); everything else indexes an Out with these.
OUT_TOPIC: Final = 0
OUT_VALUE: Final = 1
OUT_KEY: Final = 2
OUT_PARTITION: Final = 3
OUT_HEADERS: Final = 4
OUT_INPUT: Final = 5
OUT_INPUT_OFFSET: Final = 6
OUT_DEAD: Final = 7
OUT_WIDTH: Final = 8  # the items of one output in Batch.outputs


def each_out(outputs: list[Any]) -> Iterator[Out]:
    """The outputs of a Batch, one Out at a time (zip takes OUT_WIDTH items at a time off one iterator)."""
    return cast(Iterator[Out], zip(*[iter(outputs)] * OUT_WIDTH, strict=True))


class Batch:
    """Processed input records, flattened to what the transaction needs: their outputs and offsets.

    Records processed while a commit runs wait in one of these (the backlog, up to max_batch_messages
    records) for the next transaction. They are held flat, each output's fields as OUT_WIDTH items of the
    one `outputs` list (each_out() reads them back as Outs), rather than as the consumed Messages, the
    transform's OutputRecords and a tuple per record: with tens of thousands of records waiting, the
    cyclic garbage collector's full passes over ~5 objects per record cost about a third of the copy's
    throughput on the benchmark host (0.77 s of a 3.6 s copy). Not even a tuple per output: every
    tracked object that outlives its record counts towards the next young collection, and a young
    collection promotes the consumed Messages still at hand towards the full collections.
    """

    __slots__ = ("outputs", "offsets", "messages", "dead")

    def __init__(self) -> None:
        self.outputs: list[Any] = []  # OUT_WIDTH items per output, in the order of Out
        self.offsets: dict[TopicPartitionKey, int] = {}  # next offset to consume, per input partition
        self.messages = 0
        self.dead = 0

    def extend(self, later: Batch) -> None:
        self.outputs.extend(later.outputs)
        self.offsets.update(later.offsets)  # a later batch's offsets are higher
        self.messages += later.messages
        self.dead += later.dead

    def clear(self) -> None:
        self.outputs = []
        self.offsets = {}
        self.messages = self.dead = 0


def where(msg: Message) -> tuple[str, int, int]:
    topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
    assert topic is not None and partition is not None and offset is not None  # a consumed record
    return topic, partition, offset


def input_headers(msg: Message) -> list[tuple[str, HeaderValue]]:
    return cast(list[tuple[str, HeaderValue]], list(msg.headers() or []))


def input_id(msg: Message, key: TopicPartitionKey, offset: int) -> bytes:
    """The input's rk-id as it was consumed (the last one, as ids.header_value reads it), or its coordinates
    when a foreign producer wrote it. An output's rk-id is this plus ":<index>", made per output without
    headers of its own, so it stays bytes and the headers are read inline: decoded to str through
    ids.message_id_of it cost 0.5 µs, and the processor's loop with such outputs 1.3 µs a record against
    0.75-0.85 now (benchmarks/eos_loop.py --transform plain)."""
    found = None
    # A consumed record's headers are a list of (str, bytes | None) (the stubs allow more: no cast() call).
    headers: list[tuple[str, bytes | None]] | None = msg.headers()  # type: ignore[assignment]
    if headers:
        for name, value in headers:
            if name == ID_HEADER:
                found = value
    return found if found is not None else b"%s/%d/%d" % (key[0].encode(), key[1], offset)


def not_bytes(topic: str, value: object, key: object, error: TypeError) -> KafkaException:
    """What produce() refusing an output's value, key or headers with a TypeError means: they are not bytes
    and no serializer made them bytes. Kafka could never take that output, so it is refused for good, as a
    broker's refusal would be (its input is dead-lettered with this error), and the error names the fix."""
    wrong = [f"its {name} ({type(obj).__name__}) is not bytes" for name, obj in (("value", value), ("key", key))
             if obj is not None and not isinstance(obj, (bytes, bytearray, memoryview, str))]
    reason = " and ".join(wrong) or str(error)
    return KafkaException(KafkaError(KafkaError._INVALID_ARG, (
        f"an output to {topic!r} cannot be written: {reason}; return bytes from the transform, or pass "
        "value_serializer= / key_serializer= to the processor")))


def check_output(out: object) -> None:
    if not isinstance(out, OutputRecord):
        raise TypeError(f"transform must yield OutputRecord, got {type(out).__name__}")


def has_id(headers: Sequence[tuple[str, HeaderValue]]) -> bool:
    for name, _ in headers:  # noqa: SIM110 - per record: a plain loop is twice as fast as any() here
        if name == ID_HEADER:
            return True
    return False


def header_list(headers: OutputHeaders | None) -> list[tuple[str, HeaderValue]]:
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        return list(headers.items())
    return list(headers)


def label(msg: Message) -> str:
    return f"{msg.topic()}[{msg.partition()}]@{msg.offset()}"
