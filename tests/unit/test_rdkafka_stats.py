"""librdkafka's statistics as metrics: what parse() takes from a report, and what it leaves out."""

from __future__ import annotations

import json

import pytest

from reliable_kafka import telemetry
from reliable_kafka.rdkafka_stats import METRICS, StatsCollector, collector, parse

CLIENT = {"reliable_kafka.client.type": "producer", "reliable_kafka.client.instance": "1"}

# Trimmed from a real producer's report; the secrets a config may hold never appear in one, and the
# broker "name" (an address from bootstrap.servers) must not become an attribute.
REPORT = {
    "name": "orders-client#producer-1", "client_id": "orders-client", "type": "producer",
    "msg_cnt": 7, "txmsgs": 120, "rxmsgs": 0,
    "brokers": {
        "127.0.0.1:9092/bootstrap": {"nodeid": -1, "rtt": {"avg": 900, "cnt": 1}, "outbuf_cnt": 0,
                                     "waitresp_cnt": 0},
        "127.0.0.1:9093/2": {"nodeid": 2, "rtt": {"avg": 2500, "cnt": 4}, "outbuf_cnt": 3, "waitresp_cnt": 1},
        "127.0.0.1:9094/3": {"nodeid": 3, "rtt": {"avg": 0, "cnt": 0}, "outbuf_cnt": 0, "waitresp_cnt": 0},
    },
    "topics": {"orders": {"partitions": {
        "0": {"consumer_lag": 5}, "1": {"consumer_lag": -1}, "-1": {"consumer_lag": 0}}}},
}


def _points(name: str) -> list[tuple[float, dict]]:
    return parse(REPORT, CLIENT)[name]


@pytest.mark.parametrize(("name", "expected"), [
    # rtt in seconds (librdkafka reports µs), only for brokers with a node id and requests in the interval
    ("reliable_kafka.rdkafka.broker.rtt", [(0.0025, "2")]),
    ("reliable_kafka.rdkafka.broker.outbuf", [(3, "2"), (0, "3")]),
    ("reliable_kafka.rdkafka.broker.waitresp", [(1, "2"), (0, "3")]),
])
def test_broker_gauges_come_from_real_brokers_only(name: str, expected: list[tuple[float, str]]) -> None:
    assert [(v, a["reliable_kafka.broker.id"]) for v, a in _points(name)] == expected


def test_client_counts_and_consumer_lag() -> None:
    assert [v for v, _ in _points("reliable_kafka.rdkafka.messages.transmitted")] == [120]
    assert [v for v, _ in _points("reliable_kafka.rdkafka.queue.messages")] == [7]
    # -1: unknown lag, and the internal UA partition: left out
    assert [(v, a["messaging.destination.partition.id"]) for v, a in _points("reliable_kafka.rdkafka.consumer.lag")] \
        == [(5, "0")]
    assert set(parse(REPORT, CLIENT)) == set(METRICS)


def test_no_configuration_value_becomes_an_attribute() -> None:
    values = {str(v) for points in parse(REPORT, CLIENT).values() for _, attrs in points for v in attrs.values()}
    assert not any("orders-client" in v or "127.0.0.1" in v for v in values), values


def test_the_callers_stats_cb_still_gets_every_report_even_an_unreadable_one() -> None:
    seen: list[str] = []
    c = StatsCollector("consumer", 1.0, seen.append)
    c(json.dumps(REPORT))
    c("not json")
    assert len(seen) == 2
    assert c.points("reliable_kafka.rdkafka.messages.transmitted")[0][0] == 120  # the last readable report


def test_a_collector_only_with_an_interval_and_an_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    # (The SDK is stood in for: a worker process may have set a real MeterProvider in another test.)
    monkeypatch.setattr(telemetry, "metrics_enabled", lambda: True)
    assert collector({"bootstrap.servers": "x"}, "producer") is None
    assert isinstance(collector({"statistics.interval.ms": 1000}, "producer"), StatsCollector)
    monkeypatch.setattr(telemetry, "metrics_enabled", lambda: False)
    assert collector({"statistics.interval.ms": 1000}, "producer") is None, "without an SDK nothing is wrapped"


@pytest.mark.parametrize(("reason", "expected"), [
    ("MSG_SIZE_TOO_LARGE: Broker: Message size too large", "MSG_SIZE_TOO_LARGE"),
    ("_MSG_TIMED_OUT: Local: Message timed out", "_MSG_TIMED_OUT"),
    ("record too large for topic orders", "_OTHER"),
])
def test_error_type_is_the_kafka_error_code(reason: str, expected: str) -> None:
    assert telemetry.error_type(reason) == expected
