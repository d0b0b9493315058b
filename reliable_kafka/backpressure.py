"""What to do when librdkafka's local queue is full: serve delivery reports and produce again, never drop.

produce() raises BufferError when the queue holds queue.buffering.max.messages/kbytes; a program that
logs it and moves on has lost the message. Every producing loop in the package waits here instead.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Producer


def produce_when_room(
    producer: Producer, *args: Any, timeout_s: float | None = None, poll_s: float = 0.05, **kwargs: Any
) -> bool:
    """`producer.produce(*args, **kwargs)`, retried while the local queue is full, serving delivery reports
    (`poll(poll_s)`) in between so that acknowledged messages leave the queue.

    Returns True once librdkafka took the message, False when `timeout_s` passed first (None: wait as
    long as it takes; librdkafka's message.timeout.ms still fails what is queued, which frees room).
    Any other error of produce() (KafkaException, TypeError) passes through at once.

    Hot loops try produce() inline first (positional arguments: confluent-kafka parses each keyword
    at ~1 µs) and call this only on BufferError: even one extra Python call per message costs ~15%
    of a produce() that librdkafka accepts at once.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            producer.produce(*args, **kwargs)
            return True
        except BufferError:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            producer.poll(poll_s)
