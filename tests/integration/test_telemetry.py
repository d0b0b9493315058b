"""OpenTelemetry: a consumer's process span links to the send span of the producer that sent it,
through the W3C trace context carried in the message headers and the outbox (in-memory SDK exporters)."""

from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from reliable_kafka import DedupPolicy, telemetry
from reliable_kafka.consumer import ReliableConsumer
from reliable_kafka.dedup import SQLiteDedupStore
from reliable_kafka.producer import ReliableProducer
from reliable_kafka.testing.mock import MockCluster
from reliable_kafka.transactions import OutputRecord, TransactionalProcessor
from tests.fixtures.requirements import missing

pytestmark = pytest.mark.cluster

UNREACHABLE = "127.0.0.1:1"  # nothing listens there
EXPORTER = InMemorySpanExporter()
READER = InMemoryMetricReader()


@pytest.fixture(scope="module", autouse=True)
def sdk() -> None:
    # The global providers can be set once per process; the exporters are shared by this module.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
    trace.set_tracer_provider(provider)
    metrics.set_meter_provider(MeterProvider(metric_readers=[READER]))


def _consume(bootstrap: str, topic: str, count: int, **settings: object) -> list[Any]:
    """The first `count` records of `topic`, read by a ReliableConsumer of a new group (bounded: 60 s)."""
    consumer = ReliableConsumer({"bootstrap.servers": bootstrap, "group.id": f"otel-{uuid.uuid4()}", **settings},
                                [topic], dead_letter=None)
    got: list[Any] = []

    def handler(msg: Any) -> None:
        got.append(msg)
        if len(got) == count:
            consumer.stop()

    limit = threading.Timer(60, consumer.stop)
    limit.start()
    try:
        consumer.run(handler)
    finally:
        limit.cancel()
        consumer.close()
    return got


def test_consumer_process_span_links_to_the_producer_send_span(kafka, make_topic, tmp_path) -> None:
    assert telemetry.tracing_enabled()
    topic = make_topic(partitions=1)
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, outbox_path=tmp_path / "o.db") as p:
        sent = p.send(topic, b"traced", key=b"order-7")
        assert p.flush(30) == 0
        gauges = {m.name for rm in READER.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics}
        assert {"reliable_kafka.outbox.depth", "reliable_kafka.outbox.oldest_age"} & gauges
    assert len(_consume(kafka.bootstrap_servers, topic, 1)) == 1
    spans = EXPORTER.get_finished_spans()
    send = [s for s in spans if s.name == f"send {topic}"]
    process = [s for s in spans if s.name == f"process {topic}"]
    assert len(send) == 1 and len(process) == 1
    assert send[0].kind == trace.SpanKind.PRODUCER and process[0].kind == trace.SpanKind.CONSUMER
    for s in (send[0], process[0]):
        assert s.attributes["messaging.message.id"] == sent.message_id
        assert s.attributes["messaging.kafka.message.key"] == "order-7"
        assert s.attributes["messaging.operation.type"] == s.attributes["messaging.operation.name"]
    # The send span ends on the brokers' acknowledgement, with where the message landed.
    assert [(e.name, e.attributes["reliable_kafka.delivery.outcome"]) for e in send[0].events] == [
        ("delivery", "delivered")]
    assert send[0].attributes["messaging.destination.partition.id"] == "0"
    assert send[0].attributes["messaging.kafka.offset"] == process[0].attributes["messaging.kafka.offset"] == 0
    linked = [link.context for link in process[0].links]
    assert [(c.trace_id, c.span_id) for c in linked] == [
        (send[0].context.trace_id, send[0].context.span_id)
    ], "the process span must link to the send span"
    commit, = [s for s in spans if s.name == "commit"][:1]
    assert commit.attributes["messaging.operation.type"] == "settle"

    time.sleep(0.1)
    data = READER.get_metrics_data()
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert {"reliable_kafka.producer.accepted", "messaging.client.sent.messages",
            "messaging.client.operation.duration", "messaging.client.consumed.messages",
            "messaging.process.duration"} <= names


def _spans_named(name: str) -> list:
    return [s for s in EXPORTER.get_finished_spans() if s.name == name]


def _links(span) -> list[tuple[int, int]]:
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def _ids(span) -> tuple[int, int]:
    return (span.context.trace_id, span.context.span_id)


def test_the_trace_goes_through_the_transactional_processor_to_its_consumer(kafka, make_topic) -> None:
    source, output = make_topic(partitions=1, prefix="otel-in"), make_topic(partitions=1, prefix="otel-out")
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, durability="memory") as p:
        p.send(source, b"hop")
        assert p.flush(30) == 0

    # A copier that passes the input's headers on, the producer's traceparent included: the processor
    # must replace it with its own, or the hop would vanish from the trace.
    processor = TransactionalProcessor(
        {"bootstrap.servers": kafka.bootstrap_servers, "group.id": f"otel-eos-{uuid.uuid4().hex[:6]}"},
        input_topics=[source], transactional_id=f"otel-{uuid.uuid4().hex[:6]}",
        transform=lambda m: [OutputRecord(output, m.value(), m.key(), headers=m.headers())],
    )
    with processor:
        threading.Thread(target=lambda: (_wait(lambda: processor.stats().messages_committed >= 1, 60),
                                         processor.stop()), daemon=True).start()
        assert processor.run().messages_committed == 1

    got = _consume(kafka.bootstrap_servers, output, 1)
    assert [m.value() for m in got] == [b"hop"]
    assert [k for k, _ in got[0].headers()].count("traceparent") == 1

    send, = _spans_named(f"send {source}")
    hop, = _spans_named(f"process {source}")
    final, = _spans_named(f"process {output}")
    assert _links(hop) == [_ids(send)], "the processor's span must link to the producer's"
    assert _links(final) == [_ids(hop)], "the output's consumer must link to the processor's span"
    assert hop.attributes["messaging.consumer.group.name"].startswith("otel-eos-")
    assert _spans_named("commit_transaction"), "each committed transaction has its span"


def _wait(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def _counter_total(name: str) -> int:
    total = 0
    for rm in READER.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    total += sum(point.value for point in m.data.data_points)
    return total


def test_dedup_hits_are_counted(kafka, make_topic, tmp_path) -> None:
    topic = make_topic(partitions=1)
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, durability="memory") as p:
        for value in (b"first", b"copy", b"other"):  # "copy" re-sends "first" under the same message id
            p.send(topic, value, message_id="order-1" if value != b"other" else "order-2")
        assert p.flush(30) == 0
    before = _counter_total("reliable_kafka.dedup.hits")
    handled: list[bytes] = []
    with SQLiteDedupStore(tmp_path / "dedup.db") as store:
        consumer = ReliableConsumer({"bootstrap.servers": kafka.bootstrap_servers,
                                     "group.id": f"otel-dedup-{uuid.uuid4()}"}, [topic], dedup=DedupPolicy(store))
        threading.Thread(target=lambda: (_wait(lambda: consumer.stats().duplicates_skipped
                                               + len(handled) >= 3, 60), consumer.stop()), daemon=True).start()
        consumer.run(lambda m: handled.append(m.value()))
        consumer.close()
    assert handled == [b"first", b"other"]
    assert _counter_total("reliable_kafka.dedup.hits") - before == 1


def test_a_spark_write_task_is_a_send_span_its_rows_link_to(kafka, make_topic) -> None:
    if importlib.util.find_spec("pyspark") is None or importlib.util.find_spec("pyarrow") is None:
        missing("pyspark and pyarrow", "pip install -e '.[spark]'")
    import pyarrow as pa

    from reliable_kafka.spark.options import writer_options
    from reliable_kafka.spark.writer import write_partition

    topic = make_topic(partitions=1)
    options = writer_options({"kafka.bootstrap.servers": kafka.bootstrap_servers, "topic": topic,
                              "guarantee": "at_least_once", "write_id": f"otel-{uuid.uuid4().hex[:6]}"})
    rows = pa.RecordBatch.from_pydict({"value": [f"row-{i}".encode() for i in range(20)]})
    write_partition(options, [rows], partition=0, attempt=0)  # what a Spark task runs, here in-process
    task, = _spans_named(f"send {topic}")
    assert task.kind == trace.SpanKind.PRODUCER and task.attributes["reliable_kafka.spark.partition"] == 0

    got = _consume(kafka.bootstrap_servers, topic, 20)
    assert len(got) == 20
    processed = _spans_named(f"process {topic}")
    assert len(processed) == 20 and all(_links(s) == [_ids(task)] for s in processed), \
        "every row's process span must link to the task's send span"


def test_a_message_resent_after_a_restart_stays_in_its_trace(tmp_path) -> None:
    """Run 1 accepts a message while no broker is reachable and closes with it pending; run 2 opens the same
    outbox and delivers it. Its traceparent was stored with it: run 2's delivery span and the consumer's
    process span belong to run 1's trace, and the process span links to run 1's send span."""
    with MockCluster(brokers=1) as mock:
        topic = f"otel-restart-{uuid.uuid4().hex[:6]}"
        mock.create_topic(topic, partitions=1, replication_factor=1)
        outbox = tmp_path / "restart.db"
        first = ReliableProducer({"bootstrap.servers": UNREACHABLE}, outbox_path=outbox, preflight="off")
        sent = first.send(topic, b"survives")
        assert first.close(timeout=1) == 1, "control: run 1 must close with the message still pending"
        original, = [s for s in _spans_named(f"send {topic}")
                     if s.attributes["messaging.message.id"] == sent.message_id]
        assert [e.attributes["reliable_kafka.delivery.outcome"] for e in original.events] == ["pending_at_close"]

        with ReliableProducer({"bootstrap.servers": mock.bootstrap_servers}, outbox_path=outbox,
                              preflight="off") as second:
            assert second.flush(30) == 0
        resent = [s for s in _spans_named(f"send {topic}") if s is not original
                  and s.attributes["messaging.message.id"] == sent.message_id]
        assert len(resent) == 1 and resent[0].attributes["reliable_kafka.resent_from_outbox"]
        assert resent[0].context.trace_id == original.context.trace_id
        assert resent[0].parent is not None and resent[0].parent.span_id == original.context.span_id
        assert [e.attributes["reliable_kafka.delivery.outcome"] for e in resent[0].events] == ["delivered"]

        got = _consume(mock.bootstrap_servers, topic, 1, **{"auto.offset.reset": "earliest"})
    assert [m.value() for m in got] == [b"survives"]
    process = [s for s in _spans_named(f"process {topic}") if s.attributes["messaging.message.id"] == sent.message_id]
    assert len(process) == 1
    assert _links(process[0]) == [_ids(original)], "the consumer must link to the send span of run 1"
