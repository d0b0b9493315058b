"""A billing consumer that charges each order once: retries, a dead-letter topic and Redis dedup.

Guarantees shown here (see docs/guarantees.md and docs/consumer.md):

* An offset is committed only after its order was charged (or parked on the dead-letter topic with an
  acknowledged write), and never past an order that is still running: a crash redelivers, never skips.
* Redeliveries and re-published orders carry the same message id (`rk-id`); the Redis dedup store
  claims each id before the handler runs and confirms it after success, so an order is charged once.
  A failed attempt never confirms the id: a retry is never mistaken for a duplicate.
* A transient failure (here a payment gateway that times out once) is retried with backoff.
* A poison order (not JSON, or a negative total) goes to `<topic>.dlq` at once, with headers saying
  where it came from and why (rk-dlq-topic, -partition, -offset, -error-type, -error, -attempts).
* When Redis is down the consumer stops making progress (fail-closed): nothing is committed and
  nothing is charged twice; it goes on by itself when Redis is back.
* SIGTERM or Ctrl-C stops it gracefully: in-flight orders finish, offsets are committed, it leaves.

What dedup cannot do: it remembers only what Redis keeps (run Redis with `appendonly yes` and
`maxmemory-policy noeviction`), for `retention_s` (7 days by default).

Try it after examples/order_service.py:

    python examples/dlq_consumer.py --bootstrap-servers B --redis-url redis://127.0.0.1:6379/0 --create-dlq

It prints one JSON line when it stops: the orders it charged and the consumer's counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections import Counter
from typing import Any

from confluent_kafka import Message
from confluent_kafka.admin import AdminClient, NewTopic

from reliable_kafka import DeadLetterPolicy, DedupPolicy, ReliableConsumer, RetryPolicy
from reliable_kafka.dedup import RedisDedupStore  # needs the `redis` extra

log = logging.getLogger("dlq_consumer")


class InvalidOrder(ValueError):
    """The order can never be charged: retrying it is pointless, it goes to the dead-letter topic."""


class Billing:
    """The side effect: charging orders through a payment gateway that sometimes times out."""

    def __init__(self, flaky_every: int) -> None:
        self.flaky_every = flaky_every
        self.charged: list[int] = []
        self.gateway_timeouts = 0
        self._attempts: Counter[int] = Counter()
        self._lock = threading.Lock()  # handlers run on several worker threads

    def handle(self, msg: Message) -> None:
        try:
            order: dict[str, Any] = json.loads(msg.value() or b"")
            order_id, total = int(order["id"]), float(order["total"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidOrder(f"not an order: {exc}") from exc
        if total < 0:
            raise InvalidOrder(f"order {order_id} has a negative total {total}")
        with self._lock:
            self._attempts[order_id] += 1
            first_try = self._attempts[order_id] == 1
        if self.flaky_every and order_id % self.flaky_every == 0 and first_try:
            with self._lock:
                self.gateway_timeouts += 1
            raise TimeoutError(f"payment gateway timed out charging order {order_id}")  # retried
        with self._lock:
            self.charged.append(order_id)


def create_topic(bootstrap_servers: str, topic: str, partitions: int = 1) -> None:
    """Create `topic` (3 replicas, min ISR 2) unless it exists: the dead-letter topic must exist."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    if topic in admin.list_topics(timeout=10).topics:
        return
    new = NewTopic(topic, num_partitions=partitions, replication_factor=3, config={"min.insync.replicas": "2"})
    admin.create_topics([new])[topic].result(timeout=30)
    log.info("created topic %s", topic)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--topic", default="orders")
    ap.add_argument("--group", default="billing")
    ap.add_argument("--concurrency", type=int, default=4, help="worker threads; one key stays on one worker")
    ap.add_argument("--flaky-every", type=int, default=5, help="every N-th order times out once at the gateway")
    ap.add_argument("--idle-exit", type=float, default=None,
                    help="stop after this many seconds without progress (default: run until SIGTERM)")
    ap.add_argument("--create-dlq", action="store_true", help="create <topic>.dlq if it does not exist")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dlq_template = "{topic}.dlq"
    if args.create_dlq:
        create_topic(args.bootstrap_servers, dlq_template.format(topic=args.topic))

    billing = Billing(args.flaky_every)
    # One prefix per effect: every consumer that charges orders must share it, whatever its group.
    dedup = RedisDedupStore(args.redis_url, prefix="rk:dedup:billing:")
    consumer = ReliableConsumer(
        {"bootstrap.servers": args.bootstrap_servers, "group.id": args.group},
        [args.topic],
        # Three attempts with backoff for what may pass; an InvalidOrder is poison at once.
        retry=RetryPolicy(attempts=3, initial_backoff_s=0.2, max_backoff_s=2.0, give_up_on=(InvalidOrder,)),
        dead_letter=DeadLetterPolicy(template=dlq_template),
        concurrency=args.concurrency,
        dedup=DedupPolicy(dedup),  # keyed by the rk-id header unless DedupPolicy(key=...) says otherwise
    )
    # stop() only sets a flag, so it is safe in a signal handler; run() then drains and commits.
    signal.signal(signal.SIGTERM, lambda *_: consumer.stop())
    signal.signal(signal.SIGINT, lambda *_: consumer.stop())
    if args.idle_exit is not None:
        threading.Thread(target=stop_when_idle, args=(consumer, args.idle_exit), daemon=True).start()

    try:
        consumer.run(billing.handle)
    finally:
        consumer.close()  # commits what is processed and leaves the group
        dedup.close()
    print(json.dumps({"charged": sorted(billing.charged), "gateway_timeouts": billing.gateway_timeouts,
                      "counts": dict(consumer.stats())}), flush=True)
    return 0


def stop_when_idle(consumer: ReliableConsumer, idle_s: float) -> None:
    """Stop the consumer once its counts (handled, skipped, dead-lettered, commits) stop moving."""
    last, since = consumer.stats(), time.monotonic()
    while time.monotonic() - since < idle_s:
        time.sleep(0.2)
        now = consumer.stats()
        if now != last:
            last, since = now, time.monotonic()
    consumer.stop()


if __name__ == "__main__":
    sys.exit(main())
