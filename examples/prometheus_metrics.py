"""Metrics for Prometheus: the OpenTelemetry SDK with its Prometheus exporter serves `/metrics`, and a
producer and a consumer report through it (docs/operations.md lists every metric and the alerts on them).

What it shows:

* The SDK's MeterProvider is installed first, before any client exists: each client checks once, when it is
  created, whether metrics are on, and measures nothing per record when they are not.
* `statistics.interval.ms` on a client adds a subset of librdkafka's statistics (broker round-trip time,
  request queues, messages sent and fetched, librdkafka's own consumer lag) as `reliable_kafka_rdkafka_*`.
* After a run: the delivered count equals what was sent, the outbox is empty, the consumer's lag is 0
  and the handler was timed once per record.

    pip install 'reliable-kafka[metrics]'
    python examples/prometheus_metrics.py --bootstrap-servers B --topic T --port 9464
    curl -s http://127.0.0.1:9464/metrics | grep -E '^(messaging|reliable_kafka)_'

It sends and consumes `--messages` records, prints one JSON line (the port it serves on, the counts) and
serves /metrics until SIGTERM or Ctrl-C (or `--serve-s` seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
import uuid
from typing import Any

from opentelemetry import metrics
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import Resource
from prometheus_client import start_http_server

from reliable_kafka import Message, ReliableConsumer, ReliableProducer

log = logging.getLogger("prometheus_metrics")


def serve_metrics(port: int, addr: str = "127.0.0.1", service: str = "orders") -> int:
    """The recipe: Prometheus' HTTP server on `addr:port` (0: any free port) and the SDK's MeterProvider
    reading into it. Call it once per process, before creating clients. Returns the port."""
    server, _thread = start_http_server(port, addr=addr)
    reader = PrometheusMetricReader()
    metrics.set_meter_provider(MeterProvider(resource=Resource.create({"service.name": service}),
                                             metric_readers=[reader]))
    return int(server.server_port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--port", type=int, default=9464, help="0: any free port (printed)")
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--serve-s", type=float, default=None, help="stop serving after this long")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    port = serve_metrics(args.port)
    stats = {"statistics.interval.ms": 1000}  # librdkafka's statistics every second, as metrics
    producer = ReliableProducer({"bootstrap.servers": args.bootstrap_servers, **stats}, durability="memory")
    consumer = ReliableConsumer({"bootstrap.servers": args.bootstrap_servers, **stats,
                                 "group.id": f"metrics-{uuid.uuid4().hex[:8]}"}, [args.topic])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        # Keyed, so the orders spread over the partitions (each partition's lag is reported once a record
        # of it was fetched: before that, its end is not known without asking the brokers).
        producer.send_many([Message(args.topic, f"order-{i}".encode(), key=f"order-{i}".encode())
                            for i in range(args.messages)])
        pending = producer.flush(60)

        handled = 0

        def handle(_msg: Any) -> None:
            nonlocal handled
            handled += 1
            if handled >= args.messages:
                consumer.stop()

        consumer.run(handle, stop_after=120)
        # Both clients stay open while /metrics is served: the outbox and lag gauges read live clients.
        print(json.dumps({"port": port, "sent": args.messages, "pending": pending, "handled": handled,
                          "producer": dict(producer.stats()), "consumer": dict(consumer.stats())}), flush=True)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: stop serving, close the clients
            stop.wait(args.serve_s)
    finally:
        consumer.close()
        producer.close()
    return 0 if pending == 0 and handled == args.messages else 3


if __name__ == "__main__":
    sys.exit(main())
