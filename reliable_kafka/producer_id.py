"""Getting a new idempotent producer its producer id before its first message, not 0.5 s after it.

librdkafka asks for an idempotent producer's id when a metadata response arrives, and otherwise on a
500 ms retry timer. A `produce()` in a producer's first milliseconds asks for its topic's metadata through
the bootstrap connection; that answer arrives while no broker the cluster named is connected yet (the
bootstrap connection is dropped once they are known), so the id request finds no broker, and
librdkafka's 50 ms spacing of cluster connections holds back the one it would open: the next try waits
for the timer. Measured on a 3-node local cluster (`benchmarks/first_delivery.py`): a producer created and
used at once delivered its first message after 0.51-0.53 s, every time; primed as below, after
0.06-0.08 s. (Debug logs: "No brokers available for Idempotent producer", then "Starting PID FSM timer".)

Priming is two metadata requests before the first `produce()`: the first is answered through the
bootstrap connection, the second by a broker of the cluster, and that answer lets the id request go out
at once. One request alone left 3 of 24 first deliveries at 0.5 s; two left none.

Primed: the Spark writer's at_least_once producer (one per task, its rows follow at once), the producer
ReliableProducer rebuilds after a fatal error (the outbox is re-sent to it at once), and the benchmarks'
raw baselines (their clocks start as the producer is made). ReliableProducer's first producer is not: its
first produce() comes milliseconds after it is made, once the outbox and poller are set up, and it never
met the wait (`reliable_producer` in the same measurement: 0.07-0.11 s).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaException, Producer

log = logging.getLogger(__name__)

# Several times what the two requests take on a healthy cluster (here they and the first delivery took
# 0.06-0.08 s together); when no broker answers by then, the id comes on librdkafka's timer, as it would
# have without priming.
PRIME_TIMEOUT_S = 0.5


def prime_producer_id(producer: Producer, timeout_s: float = PRIME_TIMEOUT_S) -> bool:
    """Ask for the cluster's metadata twice (at most `timeout_s` in all), so that an idempotent producer
    has its producer id before its first message; True when both requests were answered.

    Never raises: a cluster that does not answer in time (down, a refused login) leaves the producer as
    it was, and it gets its id (or reports the error) as it would have.
    """
    deadline = time.monotonic() + timeout_s
    for _ in range(2):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            # Every topic's metadata: a topic name would make librdkafka ask for that topic, which a
            # broker with auto.create.topics.enable creates when it is missing.
            producer.list_topics(timeout=left)
        except KafkaException as exc:
            log.debug("producer id not primed (%s); it comes on librdkafka's retry timer", exc)
            return False
    return True
