"""Dead-letter topic names and headers: the origin and the error travel with the record, nothing is lost."""

from __future__ import annotations

import pytest
from confluent_kafka import Producer

from reliable_kafka.dlq import (
    MAX_ERROR_BYTES,
    DeadLetterInfo,
    dead_letter_headers,
    dlq_topic_for,
    parse_dead_letter_headers,
)
from reliable_kafka.errors import ConfigError
from reliable_kafka.ids import DLQ_ERROR, DLQ_OFFSET, DLQ_TIMESTAMP, DLQ_TOPIC, ID_HEADER, new_id


class PaymentDeclined(Exception):
    pass


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("broken __str__")


def test_default_dlq_topic_is_the_topic_with_a_dlq_suffix() -> None:
    assert dlq_topic_for("orders") == "orders.dlq"


@pytest.mark.parametrize(
    ("template", "expected"),
    [("dlq-{topic}", "dlq-orders"), ("{topic}_dead_{topic}", "orders_dead_orders"), ("all.dead", "all.dead")],
)
def test_custom_dlq_templates(template: str, expected: str) -> None:
    assert dlq_topic_for("orders", template) == expected


@pytest.mark.parametrize(
    "template",
    ["{topic}", "{name}.dlq", "{0}.dlq", "{topic", "{topic}/dlq", "{topic} dlq", "", ".", "x" * 250],
)
def test_dlq_templates_that_cannot_work_are_refused(template: str) -> None:
    with pytest.raises(ConfigError) as caught:
        dlq_topic_for("orders", template)
    assert caught.value.key == "dlq_topic"


def test_headers_keep_the_originals_first_and_round_trip() -> None:
    message_id = new_id()
    original: list[tuple[str, bytes | None]] = [
        (ID_HEADER, message_id.encode()),
        ("traceparent", b"00-abc-def-01"),
        ("empty", None),
        ("dup", b"1"),
        ("dup", b"2"),
    ]
    headers = dead_letter_headers(
        topic="orders",
        partition=3,
        offset=1042,
        timestamp_ms=1_700_000_000_123,
        error=PaymentDeclined("card 4242 declined"),
        attempts=5,
        original_headers=original,
    )
    assert headers[: len(original)] == original
    assert all(isinstance(key, str) for key, _ in headers)
    info = parse_dead_letter_headers(headers)
    assert info == DeadLetterInfo(
        topic="orders",
        partition=3,
        offset=1042,
        timestamp_ms=1_700_000_000_123,
        error_type=f"{__name__}.PaymentDeclined",
        error="card 4242 declined",
        attempts=5,
        message_id=message_id,
        original_headers=original,
    )


def test_mapping_and_missing_original_headers() -> None:
    common = {
        "topic": "t",
        "partition": 0,
        "offset": 7,
        "timestamp_ms": 1,
        "error": ValueError("v"),
        "attempts": 1,
    }
    from_dict = dead_letter_headers(original_headers={ID_HEADER: b"abc", "k": None}, **common)  # type: ignore[arg-type]
    assert from_dict[:2] == [(ID_HEADER, b"abc"), ("k", None)]
    assert parse_dead_letter_headers(from_dict).message_id == "abc"
    bare = parse_dead_letter_headers(dead_letter_headers(original_headers=None, **common))  # type: ignore[arg-type]
    assert bare.original_headers == []
    assert bare.message_id is None
    assert bare.error_type == "ValueError"


def test_an_unknown_timestamp_is_kept_as_unknown() -> None:
    headers = dead_letter_headers(
        topic="t",
        partition=0,
        offset=0,
        timestamp_ms=None,
        error=ValueError(),
        attempts=1,
        original_headers=None,
    )
    assert (DLQ_TIMESTAMP, b"") in headers
    info = parse_dead_letter_headers(headers)
    assert info.timestamp_ms is None
    assert info.error == "ValueError()"  # an empty message still says something


@pytest.mark.parametrize("text", ["x" * 100_000, "é" * 50_000, "日本語" * 10_000])
def test_a_huge_error_message_is_cut_on_a_character_boundary(text: str) -> None:
    headers = dead_letter_headers(
        topic="t",
        partition=0,
        offset=0,
        timestamp_ms=0,
        error=RuntimeError(text),
        attempts=2,
        original_headers=None,
    )
    value = dict(headers)[DLQ_ERROR]
    assert isinstance(value, bytes)
    assert len(value) <= MAX_ERROR_BYTES
    decoded = value.decode("utf-8")  # strict: no half character left at the cut
    assert decoded.startswith(text[:100])
    assert decoded.endswith(f"[truncated, {len(text.encode())} bytes]")


def test_the_error_size_limit_is_configurable_and_short_messages_are_untouched() -> None:
    def error_header(message: str, limit: int) -> bytes:
        headers = dead_letter_headers(
            topic="t",
            partition=0,
            offset=0,
            timestamp_ms=0,
            error=RuntimeError(message),
            attempts=1,
            original_headers=None,
            max_error_bytes=limit,
        )
        value = dict(headers)[DLQ_ERROR]
        assert isinstance(value, bytes)
        return value

    assert error_header("short", 64) == b"short"
    cut = error_header("y" * 1000, 64)
    assert len(cut) <= 64
    assert cut.startswith(b"yyyy")


def test_an_unprintable_error_does_not_stop_the_dead_letter() -> None:
    headers = dead_letter_headers(
        topic="t",
        partition=0,
        offset=0,
        timestamp_ms=0,
        error=Unprintable(),
        attempts=1,
        original_headers=None,
    )
    info = parse_dead_letter_headers(headers)
    assert info.error == "<unprintable Unprintable>"
    assert info.error_type.endswith("Unprintable")


def test_a_record_dead_lettered_twice_reports_the_latest_failure() -> None:
    """A DLQ record replayed to its topic and failing again keeps its history in the original headers."""
    first = dead_letter_headers(
        topic="orders",
        partition=1,
        offset=10,
        timestamp_ms=1,
        error=ValueError("first"),
        attempts=5,
        original_headers=[(ID_HEADER, b"id-1")],
    )
    second = dead_letter_headers(
        topic="orders-replay",
        partition=0,
        offset=99,
        timestamp_ms=2,
        error=KeyError("second"),
        attempts=3,
        original_headers=first,
    )
    info = parse_dead_letter_headers(second)
    assert (info.topic, info.partition, info.offset, info.attempts) == ("orders-replay", 0, 99, 3)
    assert info.error_type == "KeyError"
    assert info.message_id == "id-1"
    assert info.original_headers == first
    assert parse_dead_letter_headers(info.original_headers).error == "first"


def test_headers_without_a_dead_letter_block_are_refused() -> None:
    with pytest.raises(ValueError, match="not a dead-letter record"):
        parse_dead_letter_headers([(ID_HEADER, b"abc")])
    with pytest.raises(ValueError, match="not a dead-letter record"):
        parse_dead_letter_headers(None)


def test_a_malformed_dead_letter_block_is_refused() -> None:
    headers = dead_letter_headers(
        topic="t",
        partition=0,
        offset=5,
        timestamp_ms=0,
        error=ValueError("v"),
        attempts=1,
        original_headers=None,
    )
    corrupt = [(k, b"five" if k == DLQ_OFFSET else v) for k, v in headers]
    with pytest.raises(ValueError, match=DLQ_OFFSET):
        parse_dead_letter_headers(corrupt)
    nulled = [(k, None if k == DLQ_TOPIC else v) for k, v in headers]
    with pytest.raises(ValueError, match=DLQ_TOPIC):
        parse_dead_letter_headers(nulled)


def test_confluent_kafka_accepts_the_headers_as_they_are() -> None:
    """produce() checks header types when it enqueues; no broker is contacted (purged before sending)."""
    headers = dead_letter_headers(
        topic="orders",
        partition=0,
        offset=1,
        timestamp_ms=None,
        error=ValueError("v"),
        attempts=1,
        original_headers=[(ID_HEADER, b"abc"), ("null", None)],
    )
    producer = Producer({"bootstrap.servers": "127.0.0.1:1", "log_level": 0})
    try:
        producer.produce("orders.dlq", value=b"payload", key=b"k", headers=headers)
        with pytest.raises(TypeError):  # the check is real: a header value of the wrong type is refused
            producer.produce("orders.dlq", value=b"payload", headers=[*headers, ("bad", 5)])  # type: ignore[list-item]
    finally:
        producer.purge()
        producer.flush(0)
