"""OpenTelemetry: a consumer's process span links to the publish span of the producer that sent it,
through the W3C trace context carried in the message headers (in-memory SDK exporters)."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reliable_kafka import telemetry
from reliable_kafka.consumer import ReliableConsumer
from reliable_kafka.producer import ReliableProducer

pytestmark = pytest.mark.cluster

EXPORTER = InMemorySpanExporter()
READER = InMemoryMetricReader()


@pytest.fixture(scope="module", autouse=True)
def sdk() -> None:
    # The global providers can be set once per process; the exporters are shared by this module.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))


def test_consumer_process_span_links_to_the_producer_publish_span(kafka, make_topic, tmp_path) -> None:
    assert telemetry.tracing_enabled()
    topic = make_topic(partitions=1)
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, outbox_path=tmp_path / "o.db") as p:
        sent = p.send(topic, b"traced")
        assert p.flush(30) == 0
        gauges = {m.name for rm in READER.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics}
        assert {"reliable_kafka.outbox.depth", "reliable_kafka.outbox.oldest_age"} & gauges
    handled = threading.Event()
    consumer = ReliableConsumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"otel-{uuid.uuid4()}"},
                                [topic])

    def handler(_msg: object) -> None:
        handled.set()
        consumer.stop()

    threading.Timer(60, consumer.stop).start()
    consumer.run(handler)
    consumer.close()
    assert handled.is_set()
    spans = EXPORTER.get_finished_spans()
    publish = [s for s in spans if s.name == f"publish {topic}"]
    process = [s for s in spans if s.name == f"process {topic}"]
    assert len(publish) == 1 and len(process) == 1
    assert publish[0].kind == trace.SpanKind.PRODUCER and process[0].kind == trace.SpanKind.CONSUMER
    assert publish[0].attributes["messaging.message.id"] == sent.message_id
    assert process[0].attributes["messaging.message.id"] == sent.message_id
    linked = [link.context for link in process[0].links]
    assert [(c.trace_id, c.span_id) for c in linked] == [
        (publish[0].context.trace_id, publish[0].context.span_id)
    ], "the process span must link to the publish span"
    assert any(s.name == "commit" for s in spans)

    time.sleep(0.1)
    data = READER.get_metrics_data()
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {"reliable_kafka.messages.sent", "reliable_kafka.messages.delivered",
            "reliable_kafka.commit.duration"} <= names
