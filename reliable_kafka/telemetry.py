"""OpenTelemetry spans, metrics and trace propagation for reliable_kafka, on opentelemetry-api only.

With no OpenTelemetry SDK configured nothing per message is done at all (the check happens once per
client); with one, spans follow the messaging semantic conventions and the W3C trace context rides
in message headers from producer to consumer.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from opentelemetry import metrics, propagate, trace
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace import Link, SpanKind

from reliable_kafka.ids import ID_HEADER

_NAME = "reliable_kafka"
SYSTEM = "kafka"

tracer = trace.get_tracer(_NAME)
meter = metrics.get_meter(_NAME)

# Counters are added per batch, never per message, so their cost stays off the hot path.
messages_sent = meter.create_counter("reliable_kafka.messages.sent", unit="{message}",
                                     description="messages accepted into the outbox")
messages_delivered = meter.create_counter("reliable_kafka.messages.delivered", unit="{message}",
                                          description="messages confirmed by all in-sync replicas")
messages_failed = meter.create_counter("reliable_kafka.messages.failed", unit="{message}",
                                       description="messages refused by Kafka for good (kept as failed)")
retries = meter.create_counter("reliable_kafka.retries", unit="{attempt}",
                               description="re-sends and handler retries")
dead_lettered = meter.create_counter("reliable_kafka.dlq.messages", unit="{message}",
                                     description="poison records written to a dead-letter topic")
dedup_hits = meter.create_counter("reliable_kafka.dedup.hits", unit="{message}",
                                  description="redeliveries skipped because their key was already confirmed")
transaction_aborts = meter.create_counter("reliable_kafka.transactions.aborted", unit="{transaction}",
                                          description="transactions aborted")
commit_latency = meter.create_histogram("reliable_kafka.commit.duration", unit="s",
                                        description="time to commit consumer offsets")


def tracing_enabled() -> bool:
    """True once an SDK TracerProvider is installed (the API alone gives a no-op proxy)."""
    provider = trace.get_tracer_provider()
    return not isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


_producers: weakref.WeakSet[Any] = weakref.WeakSet()


def register_producer(producer: Any) -> None:
    """Report a producer's outbox depth and oldest pending age through the gauges below."""
    _producers.add(producer)


def unregister_producer(producer: Any) -> None:
    _producers.discard(producer)


def _depth(_options: Any) -> Iterator[metrics.Observation]:
    for p in list(_producers):
        yield metrics.Observation(p.pending, {"reliable_kafka.durability": p.durability.value})


def _oldest_age(_options: Any) -> Iterator[metrics.Observation]:
    for p in list(_producers):
        age = p.oldest_pending_age_s
        if age is not None:
            yield metrics.Observation(age, {"reliable_kafka.durability": p.durability.value})


meter.create_observable_gauge("reliable_kafka.outbox.depth", [_depth], unit="{message}",
                              description="messages accepted and not yet confirmed")
meter.create_observable_gauge("reliable_kafka.outbox.oldest_age", [_oldest_age], unit="s",
                              description="age of the oldest unconfirmed message")


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


def publish_span(topic: str, message_id: str, headers: list[tuple[str, bytes]]) -> None:
    """Record a `publish` span for one accepted message and carry its context in `headers`."""
    with tracer.start_as_current_span(
        f"publish {topic}", kind=SpanKind.PRODUCER,
        attributes={"messaging.system": SYSTEM, "messaging.destination.name": topic,
                    "messaging.operation.type": "publish", "messaging.message.id": message_id},
    ):
        propagate.inject(headers, setter=_SETTER)


@contextlib.contextmanager
def batch_publish_span(topic: str | None, **attributes: Any) -> Iterator[Any]:
    """One `publish` span for a batch of records (a Spark task); their headers carry context_headers()."""
    attrs: dict[str, Any] = {"messaging.system": SYSTEM, "messaging.operation.type": "publish", **attributes}
    if topic:
        attrs["messaging.destination.name"] = topic
    with tracer.start_as_current_span(f"publish {topic}" if topic else "publish", kind=SpanKind.PRODUCER,
                                      attributes=attrs) as s:
        yield s


CONTEXT_HEADERS = frozenset({"traceparent", "tracestate", "baggage"})


def context_headers() -> list[tuple[str, bytes]]:
    """The current span's context as message headers (empty when nothing is being traced)."""
    carrier: list[tuple[str, bytes]] = []
    propagate.inject(carrier, setter=_SETTER)
    return carrier


@contextlib.contextmanager
def process_span(msg: Any, group: str | None) -> Iterator[Any]:
    """A `process` span for one consumed record, linked to the span that published it."""
    headers = msg.headers() or []
    ctx = propagate.extract(headers, getter=_GETTER)
    producer_ctx = trace.get_current_span(ctx).get_span_context()
    links = [Link(producer_ctx)] if producer_ctx.is_valid else []
    message_id = next((v.decode() for k, v in headers if k == ID_HEADER and v is not None), None)
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM, "messaging.destination.name": msg.topic(),
        "messaging.operation.type": "process", "messaging.destination.partition.id": str(msg.partition()),
        "messaging.kafka.offset": msg.offset(),
    }
    if group:
        attributes["messaging.consumer.group.name"] = group
    if message_id:
        attributes["messaging.message.id"] = message_id
    with tracer.start_as_current_span(f"process {msg.topic()}", kind=SpanKind.CONSUMER, links=links,
                                      attributes=attributes) as span:
        yield span


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Any]:
    """A plain internal span (commit, transaction) with messaging.system set."""
    with tracer.start_as_current_span(name, attributes={"messaging.system": SYSTEM, **attributes}) as s:
        yield s
