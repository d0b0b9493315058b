"""OpenTelemetry spans, metrics and trace propagation for reliable_kafka, on opentelemetry-api only.

With no OpenTelemetry SDK installed nothing per message is done at all (each client checks once); with
one, names follow the messaging semantic conventions (docs/operations.md lists every span and metric)
and the W3C trace context rides in message headers, through the outbox, from producer to consumer.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

from opentelemetry import context, metrics, propagate, trace
from opentelemetry.metrics._internal import _ProxyMeterProvider  # what the API gives until an SDK is set
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import Link, SpanKind

from reliable_kafka.ids import ID_HEADER

_NAME = "reliable_kafka"
SYSTEM = "kafka"

tracer = trace.get_tracer(_NAME)
meter = metrics.get_meter(_NAME)

# The semantic conventions' buckets for durations in seconds: the SDK's default ones are made for
# milliseconds and would put every commit and handler call in the first bucket.
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)

# Attribute sets made once: counters are added per batch or per rare event, never per message.
SEND = {"messaging.system": SYSTEM, "messaging.operation.name": "send"}
RECEIVE = {"messaging.system": SYSTEM, "messaging.operation.name": "poll"}

# -- the semantic conventions' metrics --------------------------------------------------------------
sent_messages = meter.create_counter(
    "messaging.client.sent.messages", unit="{message}",
    description="messages the brokers acknowledged (all in-sync replicas); with error.type: refused for good")
consumed_messages = meter.create_counter(
    "messaging.client.consumed.messages", unit="{message}",
    description="records fetched and handed to the application")
operation_duration = meter.create_histogram(
    "messaging.client.operation.duration", unit="s", explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
    description="time of a client operation: an offset commit (commit), a transaction commit (commit_transaction)")
process_duration = meter.create_histogram(
    "messaging.process.duration", unit="s", explicit_bucket_boundaries_advisory=_DURATION_BUCKETS,
    description="time the handler took per record (per batch for a batch handler), each attempt")

# -- ours, where the conventions have none ------------------------------------------------------------
accepted = meter.create_counter("reliable_kafka.producer.accepted", unit="{message}",
                                description="messages accepted into the outbox (send() returned)")
retries = meter.create_counter("reliable_kafka.producer.retries", unit="{attempt}",
                               description="messages handed to librdkafka again after a retriable failure")
rebuilds = meter.create_counter("reliable_kafka.producer.rebuilds", unit="{rebuild}",
                                description="idempotent producers rebuilt after a fatal error (stats().recreated)")
dead_lettered = meter.create_counter("reliable_kafka.dlq.messages", unit="{message}",
                                     description="poison records written to a dead-letter topic")
dedup_hits = meter.create_counter("reliable_kafka.dedup.hits", unit="{message}",
                                  description="redeliveries skipped because their key was already confirmed")
transaction_commits = meter.create_counter("reliable_kafka.transactions.committed", unit="{transaction}",
                                           description="transactions committed")
transaction_aborts = meter.create_counter("reliable_kafka.transactions.aborted", unit="{transaction}",
                                          description="transactions aborted")


def tracing_enabled() -> bool:
    """True once an SDK TracerProvider is installed (the API alone gives a no-op proxy)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def metrics_enabled() -> bool:
    """True once an SDK MeterProvider is installed: only then is anything measured per record."""
    return not isinstance(metrics.get_meter_provider(), (_ProxyMeterProvider, metrics.NoOpMeterProvider))


def error_type(reason: str) -> str:
    """error.type for a reason as kafka_errors.describe() gives it ("CODE: text"): the code, else _OTHER."""
    code = reason.split(":", 1)[0]
    return code if code and code.lstrip("_").replace("_", "").isalnum() and code.upper() == code else "_OTHER"


# -- gauges, read when the metrics are collected (never on a client's thread) --------------------------

# What a registered client is read through: owner -> (attributes, probe). Weak keys: a client dropped
# without close() stops being reported instead of being kept alive by its metrics.
_outboxes: weakref.WeakKeyDictionary[Any, tuple[dict[str, str], Callable[[], Any]]] = weakref.WeakKeyDictionary()
_lags: weakref.WeakKeyDictionary[Any, tuple[str, Callable[[], Iterable[tuple[str, int, int]]]]] = (
    weakref.WeakKeyDictionary())


def register_producer(owner: object, durability: str, outbox_stats: Callable[[], Any]) -> None:
    """Report a producer's outbox (depth, oldest pending age, failed) through the gauges below;
    `outbox_stats()` returns a SpoolStats and must not hold `owner`."""
    _outboxes[owner] = ({"reliable_kafka.durability": durability}, outbox_stats)


def unregister_producer(owner: object) -> None:
    _outboxes.pop(owner, None)


def register_consumer(owner: object, group: str, lag: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
    """Report a consumer's lag per partition, `lag()` giving (topic, partition, records behind)."""
    _lags[owner] = (group, lag)


def unregister_consumer(owner: object) -> None:
    _lags.pop(owner, None)


def _outbox_gauge(field: str) -> Callable[[Any], Iterator[metrics.Observation]]:
    def observe(_options: Any) -> Iterator[metrics.Observation]:
        for attrs, outbox_stats in list(_outboxes.values()):
            try:
                value = getattr(outbox_stats(), field)
            except Exception:  # closed meanwhile: it is unregistered right after
                continue
            if value is not None:
                yield metrics.Observation(value, attrs)
    return observe


def _lag(_options: Any) -> Iterator[metrics.Observation]:
    for group, lag in list(_lags.values()):
        try:
            lags = list(lag())
        except Exception:  # closed meanwhile
            continue
        for topic, partition, behind in lags:
            yield metrics.Observation(behind, {
                "messaging.system": SYSTEM, "messaging.consumer.group.name": group,
                "messaging.destination.name": topic, "messaging.destination.partition.id": str(partition)})


meter.create_observable_gauge("reliable_kafka.outbox.depth", [_outbox_gauge("pending")], unit="{message}",
                              description="messages accepted and not yet confirmed")
meter.create_observable_gauge("reliable_kafka.outbox.oldest_age", [_outbox_gauge("oldest_pending_age_s")], unit="s",
                              description="age of the oldest unconfirmed message")
meter.create_observable_gauge("reliable_kafka.outbox.failed", [_outbox_gauge("failed")], unit="{message}",
                              description="messages Kafka refused for good, kept in the outbox as failed")
meter.create_observable_gauge("reliable_kafka.consumer.lag", [_lag], unit="{message}",
                              description="records behind the partition's end: high watermark - committed offset")


# -- handler timing --------------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])


def _process_attrs(topic: str | None, group: str, cache: dict[str | None, dict[str, str]]) -> dict[str, str]:
    attrs = cache.get(topic)
    if attrs is None:
        attrs = {"messaging.system": SYSTEM, "messaging.operation.name": "process",
                 "messaging.consumer.group.name": group}
        if topic:
            attrs["messaging.destination.name"] = topic
        cache[topic] = attrs
    return attrs


def timed_handler(handler: _F, group: str, *, batch: bool = False) -> _F:
    """`handler` recording messaging.process.duration per call (a failed call with error.type).
    Wrapped once per run(), and only when metrics are on: without an SDK no record pays for it."""
    cache: dict[str | None, dict[str, str]] = {}
    record, clock = process_duration.record, time.perf_counter

    @functools.wraps(handler)
    def timed(arg: Any) -> Any:
        topic = None if batch else arg.topic()
        started = clock()
        try:
            result = handler(arg)
        except BaseException as exc:
            record(clock() - started, {**_process_attrs(topic, group, cache), "error.type": type(exc).__qualname__})
            raise
        record(clock() - started, _process_attrs(topic, group, cache))
        return result

    return timed  # type: ignore[return-value]


def timed_async_handler(handler: Callable[[Any], Awaitable[Any]], group: str) -> Callable[[Any], Awaitable[Any]]:
    """timed_handler() for an async handler: the time until its coroutine finished."""
    cache: dict[str | None, dict[str, str]] = {}
    record, clock = process_duration.record, time.perf_counter

    @functools.wraps(handler)
    async def timed(msg: Any) -> Any:
        topic = msg.topic()
        started = clock()
        try:
            result = await handler(msg)
        except BaseException as exc:
            record(clock() - started, {**_process_attrs(topic, group, cache), "error.type": type(exc).__qualname__})
            raise
        record(clock() - started, _process_attrs(topic, group, cache))
        return result

    return timed


# -- trace context in message headers ----------------------------------------------------------------

class _HeaderSetter(Setter[list[tuple[str, bytes]]]):
    def set(self, carrier: list[tuple[str, bytes]], key: str, value: str) -> None:
        carrier.append((key, value.encode()))


class _HeaderGetter(Getter[Sequence[tuple[str, Any]]]):
    def get(self, carrier: Sequence[tuple[str, Any]], key: str) -> list[str] | None:
        found = [v.decode() if isinstance(v, bytes) else str(v) for k, v in carrier if k == key and v is not None]
        return found or None

    def keys(self, carrier: Sequence[tuple[str, Any]]) -> list[str]:
        return [k for k, _ in carrier]


_SETTER, _GETTER = _HeaderSetter(), _HeaderGetter()

CONTEXT_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})


def context_headers() -> list[tuple[str, bytes]]:
    """The current span's context as message headers (empty when nothing is being traced)."""
    carrier: list[tuple[str, bytes]] = []
    propagate.inject(carrier, setter=_SETTER)
    return carrier


def inject(span: trace.Span, headers: list[tuple[str, bytes]]) -> None:
    """Append `span`'s context (traceparent, tracestate, baggage) to `headers`."""
    propagate.inject(headers, context=trace.set_span_in_context(span), setter=_SETTER)


def extract(headers: Sequence[tuple[str, Any]]) -> context.Context:
    """The context a message's headers carry (an empty one when they carry none)."""
    return propagate.extract(headers, getter=_GETTER)


def message_id_of(headers: Sequence[tuple[str, Any]]) -> str | None:
    return next((v.decode() for k, v in headers if k == ID_HEADER and v is not None), None)


def _key_attribute(key: Any) -> str | None:
    """messaging.kafka.message.key: a key with a canonical string form only (UTF-8 text), as the conventions say."""
    if key is None:
        return None
    if isinstance(key, str):
        return key
    if isinstance(key, bytes):
        try:
            return key.decode()
        except UnicodeDecodeError:
            return None
    return None


# -- spans -----------------------------------------------------------------------------------------

def start_send_span(topic: str, message_id: str, key: Any = None, *,
                    parent: context.Context | None = None, **attributes: Any) -> trace.Span:
    """A `send {topic}` span (not made current): ended by the caller once the brokers answered."""
    attrs: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.operation.name": "send",
                             "messaging.operation.type": "send", "messaging.destination.name": topic,
                             "messaging.message.id": message_id, **attributes}
    text_key = _key_attribute(key)
    if text_key is not None:
        attrs["messaging.kafka.message.key"] = text_key
    return tracer.start_span(f"send {topic}", context=parent, kind=SpanKind.PRODUCER, attributes=attrs)


@contextlib.contextmanager
def batch_send_span(topic: str | None, **attributes: Any) -> Iterator[Any]:
    """One `send` span for a batch of records (a Spark task); their headers carry context_headers()."""
    attrs: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.operation.name": "send",
                             "messaging.operation.type": "send", **attributes}
    if topic:
        attrs["messaging.destination.name"] = topic
    with tracer.start_as_current_span(f"send {topic}" if topic else "send", kind=SpanKind.PRODUCER,
                                      attributes=attrs) as s:
        yield s


@contextlib.contextmanager
def process_span(msg: Any, group: str | None) -> Iterator[Any]:
    """A `process {topic}` span for one consumed record, linked to the span that sent it."""
    headers = msg.headers() or []
    producer_ctx = trace.get_current_span(extract(headers)).get_span_context()
    links = [Link(producer_ctx)] if producer_ctx.is_valid else []
    message_id = message_id_of(headers)
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM, "messaging.destination.name": msg.topic(),
        "messaging.operation.name": "process", "messaging.operation.type": "process",
        "messaging.destination.partition.id": str(msg.partition()), "messaging.kafka.offset": msg.offset(),
    }
    text_key = _key_attribute(msg.key())
    if text_key is not None:
        attributes["messaging.kafka.message.key"] = text_key
    if group:
        attributes["messaging.consumer.group.name"] = group
    if message_id:
        attributes["messaging.message.id"] = message_id
    with tracer.start_as_current_span(f"process {msg.topic()}", kind=SpanKind.CONSUMER, links=links,
                                      attributes=attributes) as span:
        yield span


class Settling:
    """What a settle operation's caller may say about its outcome (an operation that fails by value)."""

    def __init__(self, span: trace.Span, attrs: dict[str, Any]) -> None:
        self._span, self.attrs = span, attrs

    def failed(self, reason: str) -> None:
        self.attrs["error.type"] = error_type(reason)
        self._span.set_attribute("error.type", self.attrs["error.type"])
        self._span.set_status(trace.Status(trace.StatusCode.ERROR, reason))


@contextlib.contextmanager
def settle(operation: str, group: str, **attributes: Any) -> Iterator[Settling]:
    """A settle operation (`commit` of offsets, `commit_transaction`): its span (a no-op without an SDK)
    and its messaging.client.operation.duration; one that raises records no duration."""
    attrs: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.operation.name": operation,
                             "messaging.operation.type": "settle", "messaging.consumer.group.name": group}
    started = time.perf_counter()
    with tracer.start_as_current_span(operation, kind=SpanKind.CLIENT, attributes={**attrs, **attributes}) as s:
        settling = Settling(s, attrs)
        yield settling
    operation_duration.record(time.perf_counter() - started, settling.attrs)
