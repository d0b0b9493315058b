"""A payment processor on the exactly-once helper: each payment request becomes ledger entries once.

Guarantees shown here (see docs/guarantees.md and docs/exactly-once.md):

* For every request on `--input`, the two ledger entries (debit the payer, credit the payee) and the
  "payment completed" event are written in **one Kafka transaction** together with the request's
  consumed offset. A `read_committed` reader sees all three exactly once, or none of them yet.
* A crash (SIGKILL included) mid-batch leaves an open transaction that the restart aborts: nothing of
  it is visible, and the requests are processed again, so the ledger never has a hole or a double
  entry. The ledger's debits and credits therefore always sum to zero.
* A request that can never be booked (not JSON, a non-positive amount) goes to `<input>.dlq` in the
  same transaction, with headers saying where it came from and why; processing goes on.
* Every output carries a deterministic `rk-id` ("<request rk-id>:<index>"), so consumers further
  down can deduplicate even if they read with read_uncommitted by mistake.
* SIGTERM or Ctrl-C stops it gracefully: what is processed is committed, then it leaves the group.

What it cannot do: effects outside Kafka (an e-mail, a bank API call) are not part of the transaction;
for those, use a ReliableConsumer with a dedup store (examples/dlq_consumer.py).

Try it:

    python examples/payment_processor.py --bootstrap-servers B --create-topics --demo-requests 100 \
        --idle-exit 5

It prints one JSON line when it stops: the processor's counts.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator

from confluent_kafka import Message
from confluent_kafka.admin import AdminClient, NewTopic

from reliable_kafka import OutputRecord, ReliableProducer, RetryPolicy, TransactionalProcessor

log = logging.getLogger("payment_processor")


class InvalidPayment(ValueError):
    """The request can never be booked: it goes to the dead-letter topic."""


def book(msg: Message, ledger_topic: str, events_topic: str, delay_s: float) -> Iterator[OutputRecord]:
    """The transform: one request in, two ledger entries and one event out (all or nothing)."""
    try:
        req = json.loads(msg.value() or b"")
        payment_id, payer, payee = str(req["payment_id"]), str(req["from"]), str(req["to"])
        amount = int(req["amount_cents"])
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidPayment(f"not a payment request: {exc}") from exc
    if amount <= 0:
        raise InvalidPayment(f"payment {payment_id} has a non-positive amount {amount}")
    if delay_s:
        time.sleep(delay_s)  # stands for real work; makes a crash land inside a transaction
    for account, delta in ((payer, -amount), (payee, amount)):
        entry = {"payment_id": payment_id, "account": account, "delta_cents": delta}
        # Keyed by account: one account's entries stay in order on one partition.
        yield OutputRecord(ledger_topic, json.dumps(entry).encode(), key=account.encode())
    done = {"payment_id": payment_id, "status": "completed", "amount_cents": amount}
    yield OutputRecord(events_topic, json.dumps(done).encode(), key=payment_id.encode())


def create_topics(bootstrap_servers: str, topics: dict[str, int]) -> None:
    """Create the topics (3 replicas, min ISR 2) that do not exist yet."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    existing = admin.list_topics(timeout=10).topics
    new = [NewTopic(t, num_partitions=n, replication_factor=3, config={"min.insync.replicas": "2"})
           for t, n in topics.items() if t not in existing]
    if new:
        for topic, future in admin.create_topics(new).items():
            future.result(timeout=30)
            log.info("created topic %s", topic)


def publish_demo_requests(bootstrap_servers: str, topic: str, count: int) -> None:
    """Publish `count` requests through the reliable producer (every 25th one is invalid)."""
    with ReliableProducer({"bootstrap.servers": bootstrap_servers}, durability="memory") as producer:
        for i in range(1, count + 1):
            amount = -5 if i % 25 == 0 else 100 * i
            body = {"payment_id": f"p-{i}", "from": f"acct-{i % 7}", "to": "merchant-1", "amount_cents": amount}
            producer.send(topic, json.dumps(body).encode(), key=f"p-{i}".encode(), message_id=f"payment-request-{i}")
        producer.flush(60)


def stop_when_idle(processor: TransactionalProcessor, idle_s: float, first_wait_s: float = 60.0) -> None:
    """Stop the processor once it has committed nothing new for `idle_s` seconds.

    The clock starts at the first commit (joining the group and fencing a previous incarnation take
    a while), or after `first_wait_s` when there is nothing to do at all.
    """
    last, since, patience = processor.stats(), time.monotonic(), max(idle_s, first_wait_s)
    while time.monotonic() - since < patience:
        time.sleep(0.2)
        now = processor.stats()
        if now != last:
            last, since, patience = now, time.monotonic(), idle_s
    processor.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--input", default="payments.requested")
    ap.add_argument("--ledger-topic", default="ledger.entries")
    ap.add_argument("--events-topic", default="payments.completed")
    ap.add_argument("--group", default="payment-processor")
    ap.add_argument("--instance", default="0", help="stable per instance: the transactional.id suffix")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="work per request, in milliseconds")
    ap.add_argument("--create-topics", action="store_true", help="create the topics and <input>.dlq if missing")
    ap.add_argument("--demo-requests", type=int, default=0, help="publish this many requests first")
    ap.add_argument("--idle-exit", type=float, default=None,
                    help="stop after this many seconds without a commit (default: run until SIGTERM)")
    ap.add_argument("--linger-ms", type=float, default=None,
                    help="how long booked entries wait in the producer before they are sent (default: until "
                         "their transaction commits; no reader sees them earlier)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.create_topics:
        create_topics(args.bootstrap_servers, {args.input: 3, f"{args.input}.dlq": 1, args.ledger_topic: 3,
                                               args.events_topic: 3})
    if args.demo_requests:
        publish_demo_requests(args.bootstrap_servers, args.input, args.demo_requests)

    delay_s = args.delay_ms / 1000
    processor = TransactionalProcessor(
        {"bootstrap.servers": args.bootstrap_servers, "group.id": args.group},
        input_topics=[args.input],
        transform=lambda msg: book(msg, args.ledger_topic, args.events_topic, delay_s),
        # A restart with the same id fences the previous incarnation and aborts what it left open.
        transactional_id=f"{args.group}-{args.instance}",
        # Static membership: a restarted instance takes its partitions back at once, instead of
        # waiting for the group to notice (session.timeout.ms) that the crashed one is gone.
        consumer_overrides={"group.instance.id": f"{args.group}-{args.instance}"},
        max_batch_interval_s=0.2,
        producer_overrides={} if args.linger_ms is None else {"linger.ms": args.linger_ms},
        # A transient failure is retried (the transaction stays open meanwhile); an invalid request is
        # dead-lettered at once.
        retry=RetryPolicy(attempts=3, initial_backoff_s=0.1, max_backoff_s=1.0, give_up_on=(InvalidPayment,)),
    )
    signal.signal(signal.SIGTERM, lambda *_: processor.stop())
    signal.signal(signal.SIGINT, lambda *_: processor.stop())
    with processor:
        if args.idle_exit is not None:
            threading.Thread(target=stop_when_idle, args=(processor, args.idle_exit), daemon=True).start()
        stats = processor.run()
    print(json.dumps({"stats": dict(stats)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
