"""librdkafka's statistics (`statistics.interval.ms`) as OpenTelemetry metrics: a small documented subset.

A client whose config sets the interval, with an SDK MeterProvider installed, gets a stats_cb that keeps
the latest report (the caller's own stats_cb still gets every one). Only numbers and librdkafka's own
broker ids and topic names become metrics or attributes: never a configuration value.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from opentelemetry import metrics

from reliable_kafka import telemetry

log = logging.getLogger(__name__)

# name -> (kind, unit, description): what parse() reports, and docs/operations.md's table.
METRICS: dict[str, tuple[str, str, str]] = {
    "reliable_kafka.rdkafka.broker.rtt": (
        "gauge", "s", "average round-trip time of requests to the broker over the last interval (rtt.avg)"),
    "reliable_kafka.rdkafka.broker.outbuf": (
        "gauge", "{request}", "requests waiting to be sent to the broker (outbuf_cnt)"),
    "reliable_kafka.rdkafka.broker.waitresp": (
        "gauge", "{request}", "requests sent to the broker and waiting for its answer (waitresp_cnt)"),
    "reliable_kafka.rdkafka.queue.messages": (
        "gauge", "{message}", "messages in the producer's queues, not yet acknowledged (msg_cnt)"),
    "reliable_kafka.rdkafka.messages.transmitted": (
        "counter", "{message}", "messages sent to brokers by this client handle (txmsgs)"),
    "reliable_kafka.rdkafka.messages.received": (
        "counter", "{message}", "messages fetched from brokers by this client handle (rxmsgs)"),
    "reliable_kafka.rdkafka.consumer.lag": (
        "gauge", "{message}", "librdkafka's own consumer_lag per partition: high watermark - committed offset"),
}

Point = tuple[float, dict[str, Any]]


def parse(report: Mapping[str, Any], client: Mapping[str, str]) -> dict[str, list[Point]]:
    """The METRICS of one statistics report, each a list of (value, attributes); `client` is added to
    every attribute set. Bootstrap and internal brokers (no node id) and unknown values (-1) are left out."""
    out: dict[str, list[Point]] = {name: [] for name in METRICS}
    for broker in (report.get("brokers") or {}).values():
        node = broker.get("nodeid", -1)
        if not isinstance(node, int) or node < 0:
            continue
        attrs = {**client, "reliable_kafka.broker.id": str(node)}
        rtt = broker.get("rtt") or {}
        if rtt.get("cnt"):
            out["reliable_kafka.rdkafka.broker.rtt"].append((rtt.get("avg", 0) / 1e6, attrs))  # librdkafka: µs
        out["reliable_kafka.rdkafka.broker.outbuf"].append((broker.get("outbuf_cnt", 0), attrs))
        out["reliable_kafka.rdkafka.broker.waitresp"].append((broker.get("waitresp_cnt", 0), attrs))
    if report.get("type") == "producer":
        out["reliable_kafka.rdkafka.queue.messages"].append((report.get("msg_cnt", 0), dict(client)))
    out["reliable_kafka.rdkafka.messages.transmitted"].append((report.get("txmsgs", 0), dict(client)))
    out["reliable_kafka.rdkafka.messages.received"].append((report.get("rxmsgs", 0), dict(client)))
    for topic, t in (report.get("topics") or {}).items():
        for pid, p in (t.get("partitions") or {}).items():
            lag = p.get("consumer_lag", -1)
            if pid == "-1" or not isinstance(lag, int) or lag < 0:
                continue  # -1: the UA partition, or a partition this client does not consume
            out["reliable_kafka.rdkafka.consumer.lag"].append(
                (lag, {**client, "messaging.destination.name": topic, "messaging.destination.partition.id": pid}))
    return out


_instances = itertools.count(1)
_collectors: weakref.WeakSet[StatsCollector] = weakref.WeakSet()


class StatsCollector:
    """A client's stats_cb: parses each report and keeps the latest for the gauges below."""

    def __init__(self, client_type: str, interval_s: float, user_cb: Callable[[str], Any] | None) -> None:
        # The handle's own number, not its client.id: attributes never carry configuration values.
        self._client = {"reliable_kafka.client.type": client_type,
                        "reliable_kafka.client.instance": str(next(_instances))}
        self._user_cb = user_cb
        # A report older than this is a closed handle's: it is no longer reported.
        self._stale_s = max(3 * interval_s, 5.0)
        self._latest: dict[str, list[Point]] = {}
        self._at = 0.0
        _collectors.add(self)

    def __call__(self, stats_json: str) -> None:
        try:
            self._latest = parse(json.loads(stats_json), self._client)
            self._at = time.monotonic()
        except (ValueError, TypeError, AttributeError) as exc:  # a report we cannot read costs only its metrics
            log.debug("unreadable librdkafka statistics: %s", exc)
        if self._user_cb is not None:
            self._user_cb(stats_json)

    def points(self, name: str) -> list[Point]:
        if time.monotonic() - self._at > self._stale_s:
            return []
        return self._latest.get(name, [])


def collector(config: Mapping[str, Any], client_type: str) -> StatsCollector | None:
    """A StatsCollector to set as `stats_cb` when `config` sets statistics.interval.ms and metrics are on;
    None otherwise (the config's own stats_cb, if any, then stays as it is)."""
    try:
        interval_ms = int(config.get("statistics.interval.ms", 0) or 0)
    except (TypeError, ValueError):
        return None  # librdkafka refuses it with its own message
    if interval_ms <= 0 or not telemetry.metrics_enabled():
        return None
    return StatsCollector(client_type, interval_ms / 1000, config.get("stats_cb"))


def _observe(name: str) -> Callable[[Any], Iterator[metrics.Observation]]:
    def observe(_options: Any) -> Iterator[metrics.Observation]:
        for c in list(_collectors):
            for value, attrs in c.points(name):
                yield metrics.Observation(value, attrs)
    return observe


for _name, (_kind, _unit, _description) in METRICS.items():
    _create = (telemetry.meter.create_observable_counter if _kind == "counter"
               else telemetry.meter.create_observable_gauge)
    _create(_name, [_observe(_name)], unit=_unit, description=_description)
