"""A producer process that the crash tests SIGKILL at random points.

It writes each value's index to a ledger file as soon as the client said "accepted" (send()
returned for ReliableProducer; produce() returned for the bare control), so the ledger is exactly
what the application believed was safe when it died. With --status it also keeps, in that file,
how many accepted messages are not delivered yet: a kill gated on it always catches some in flight.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from confluent_kafka import Producer

from reliable_kafka import Message, ReliableProducer


def _publish_pending(path: str | None, pending: int) -> None:
    if path is None:
        return
    # Replaced atomically: the gate reading it never sees half a number.
    with open(f"{path}.tmp", "w") as f:
        f.write(f"{pending}\n")
    os.replace(f"{path}.tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["reliable", "control"], required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--outbox")
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--end", type=int, required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--status", help="file kept holding the number of accepted, undelivered messages")
    ap.add_argument("--batch", type=int, default=50)
    args = ap.parse_args()
    # Into the member log the tests keep per child: what each run started from and how it ended.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.info("%s producer: indexes %d..%d to %s", args.mode, args.start, args.end - 1, args.topic)

    ledger = open(args.ledger, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    if args.mode == "reliable":
        producer = ReliableProducer(
            {"bootstrap.servers": args.bootstrap, "linger.ms": 20}, outbox_path=args.outbox, preflight="off"
        )
        for start in range(args.start, args.end, args.batch):
            idx = range(start, min(start + args.batch, args.end))
            # The application's own id per value: re-sending a value it had not recorded as accepted
            # (killed between send_many() and the ledger write) carries the same rk-id as the original.
            producer.send_many([Message(args.topic, f"v-{i}".encode(), message_id=f"v-{i}") for i in idx])
            ledger.write("".join(f"{i}\n" for i in idx))
            _publish_pending(args.status, producer.pending)
        remaining = producer.close(timeout=60)
        _publish_pending(args.status, remaining)
        logging.info("closed with %d undelivered", remaining)
        return 0 if remaining == 0 else 3
    control = Producer({"bootstrap.servers": args.bootstrap, "acks": "all", "linger.ms": 20})
    for i in range(args.start, args.end):
        control.produce(args.topic, f"v-{i}".encode())
        control.poll(0)
        ledger.write(f"{i}\n")
        if i % args.batch == args.batch - 1:
            _publish_pending(args.status, len(control))  # queued or awaiting the broker's answer
    remaining = control.flush(60)
    _publish_pending(args.status, remaining)
    logging.info("flushed with %d undelivered", remaining)
    return 0


if __name__ == "__main__":
    sys.exit(main())
