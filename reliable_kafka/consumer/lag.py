"""Consumer lag per partition from what the client already holds: no request to the brokers.

Lag is the partition's high watermark (librdkafka caches it from every fetch) minus the offset this
consumer last committed for it — what a restart would start from — or, before its first commit, its fetch
position. Read when metrics are collected, on the collector's thread (librdkafka's calls are thread-safe).
"""

from __future__ import annotations

from confluent_kafka import Consumer

from reliable_kafka.offsets import OffsetTracker


def partition_lag(client: Consumer, tracker: OffsetTracker) -> list[tuple[str, int, int]]:
    """(topic, partition, records behind) for each assigned partition whose end and start are known."""
    assigned = client.assignment()
    if not assigned:
        return []
    committed = tracker.committed()
    positions = {(tp.topic, tp.partition): tp.offset for tp in client.position(assigned)}
    lags = []
    for tp in assigned:
        _low, high = client.get_watermark_offsets(tp, cached=True)
        start = committed.get((tp.topic, tp.partition), positions.get((tp.topic, tp.partition), -1))
        if high is None or high < 0 or start < 0:
            continue  # nothing fetched yet: the end or the start is unknown (librdkafka's OFFSET_INVALID)
        lags.append((tp.topic, tp.partition, max(0, high - start)))
    return lags
