"""An order service that publishes every order through the outbox: an accepted order is never lost.

Guarantees shown here (see docs/guarantees.md):

* `send()` returns only once the order is in the SQLite outbox (durability "process": it survives a
  crash of this process). It leaves the outbox only when every in-sync replica has it (acks=all).
* On restart the producer first re-sends what the outbox still holds, in the original order.
* Every order carries its id as the message id (`rk-id` header, here "order-<id>"), so a copy sent
  again after a crash, or a re-published order, is recognisable downstream: examples/dlq_consumer.py
  charges each order once.
* An order Kafka refuses for good (too large, unknown topic, not authorised) raises DeliveryFailed and
  stays in the outbox as "failed" with the broker's reason: see `reliable-kafka outbox list-failed`.

Try it against a cluster (e.g. `reliable-kafka cluster start`):

    python examples/order_service.py --bootstrap-servers B --create-topic
    python examples/order_service.py --bootstrap-servers B --orders 50 --crash   # killed at once
    python examples/order_service.py --bootstrap-servers B --first-id 51         # re-sends, then goes on

It prints one JSON line: what it found in the outbox at start, what it accepted, what was delivered.
Exit status: 0 when everything was delivered, 3 when orders are still pending (they stay in the
outbox and are sent on the next start), 2 when the topic cannot keep acks=all durable.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import Any

from confluent_kafka.admin import AdminClient, NewTopic

from reliable_kafka import DeliveryFailed, ReliableProducer, TopicConfigError

log = logging.getLogger("order_service")


def create_topic(bootstrap_servers: str, topic: str, partitions: int = 3) -> None:
    """Create `topic` with the settings the producer's preflight asks for (3 replicas, min ISR 2)."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    if topic in admin.list_topics(timeout=10).topics:
        return
    new = NewTopic(topic, num_partitions=partitions, replication_factor=3, config={"min.insync.replicas": "2"})
    admin.create_topics([new])[topic].result(timeout=30)
    log.info("created topic %s", topic)


def make_order(order_id: int) -> dict[str, Any]:
    """A made-up order; a real service would take it from a request or its database."""
    return {"id": order_id, "customer": f"c-{order_id % 7}", "total": round(10 + order_id * 1.25, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--topic", default="orders")
    ap.add_argument("--outbox", default="orders.outbox", help="the outbox file; keep it across restarts")
    ap.add_argument("--orders", type=int, default=10, help="how many orders to publish")
    ap.add_argument("--first-id", type=int, default=1, help="id of the first order")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for delivery at exit")
    ap.add_argument("--create-topic", action="store_true", help="create the topic if it does not exist")
    ap.add_argument("--crash", action="store_true",
                    help="SIGKILL this process right after the orders were accepted (no flush, no close)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.create_topic:
        create_topic(args.bootstrap_servers, args.topic)

    producer = ReliableProducer(
        {"bootstrap.servers": args.bootstrap_servers},
        outbox_path=args.outbox,
        durability="process",
        value_serializer=lambda order: json.dumps(order).encode(),
        key_serializer=str.encode,
    )
    # Whatever an earlier run accepted but could not confirm is already being re-sent, ahead of
    # anything new: pending > 0 here means the last run crashed or stopped with orders in flight.
    pending_at_start = producer.pending
    if pending_at_start:
        log.info("the outbox holds %d order(s) from an earlier run; re-sending them first", pending_at_start)
        # Not needed for safety (new orders queue behind them anyway); it makes the restart visible and
        # frees their ids, so the same orders may be published again.
        producer.flush(args.timeout)

    accepted: list[int] = []
    refused: dict[int, str] = {}
    try:
        for order_id in range(args.first_id, args.first_id + args.orders):
            order = make_order(order_id)
            try:
                # Key = customer: one customer's orders stay in order on one partition.
                producer.send(args.topic, order, key=order["customer"], message_id=f"order-{order_id}")
            except DeliveryFailed as exc:
                refused[order_id] = exc.reason  # kept in the outbox as failed, with this reason
                continue
            accepted.append(order_id)
    except TopicConfigError as exc:
        log.error("%s", exc)
        producer.close(timeout=0)
        return 2

    result: dict[str, Any] = {"outbox": os.path.abspath(args.outbox), "pending_at_start": pending_at_start,
                              "accepted": accepted, "refused": refused}
    if args.crash:
        # What a crash looks like to the outbox: accepted orders not yet confirmed are still in it.
        print(json.dumps({**result, "crashed": True}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    producer.flush(args.timeout)
    failed = {row.message_id: row.last_error for row in producer.failed()}
    # close() hands back how many are still pending; they stay in the outbox for the next start.
    pending_at_exit = producer.close(timeout=args.timeout)
    print(json.dumps({**result, "failed": failed, "pending_at_exit": pending_at_exit}), flush=True)
    return 0 if pending_at_exit == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
