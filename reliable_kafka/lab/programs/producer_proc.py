"""A producer process that the crash tests SIGKILL at random points.

It writes each value's index to a ledger file as soon as the client said "accepted" (send()
returned for ReliableProducer; produce() returned for the bare control), so the ledger is exactly
what the application believed was safe when it died. The async modes do the same from many asyncio
tasks at once (`await send()` of AsyncReliableProducer; `await produce()` of confluent-kafka's
AIOProducer, or produce() of a plain Producer where AIOProducer is missing), and fsync each line.
With --status it also keeps, in that file, how many accepted messages are not delivered yet: a kill
gated on it always catches some in flight. The connection settings come in the environment (the lab's
login on a secured cluster, see testing.child_connection), or --bootstrap alone for an open cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from confluent_kafka import Producer

from reliable_kafka import AsyncReliableProducer, Message, ReliableProducer
from reliable_kafka.testing.child_connection import connection_from_env


def _publish_pending(path: str | None, pending: int) -> None:
    if path is None:
        return
    # Replaced atomically: the gate reading it never sees half a number.
    with open(f"{path}.tmp", "w") as f:
        f.write(f"{pending}\n")
    os.replace(f"{path}.tmp", path)


async def _run_async(args: argparse.Namespace, connection: dict[str, Any]) -> int:
    """Many tasks, each sending the next index and recording it (write + fsync) once the send returned."""
    fd = os.open(args.ledger, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    indexes = iter(range(args.start, args.end))
    recorded = itertools.count(1)

    async def worker(send: Callable[[int], Awaitable[object]], pending: Callable[[], int]) -> None:
        for i in indexes:
            await send(i)
            os.write(fd, f"{i}\n".encode())
            os.fsync(fd)
            if next(recorded) % args.batch == 0:
                _publish_pending(args.status, pending())

    if args.mode == "async":
        producer = AsyncReliableProducer({**connection, "linger.ms": 20},
                                         outbox_path=args.outbox, preflight="off")
        await producer.start()

        async def send(i: int) -> object:
            return await producer.send(args.topic, f"v-{i}".encode(), message_id=f"v-{i}")

        await asyncio.gather(*(worker(send, lambda: producer.sync.pending) for _ in range(args.concurrency)))
        remaining = await producer.close(timeout=60)
        _publish_pending(args.status, remaining)
        logging.info("closed with %d undelivered", remaining)
        return 0 if remaining == 0 else 3
    conf = {**connection, "acks": "all", "linger.ms": 20}
    try:
        from confluent_kafka.aio import AIOProducer
    except ImportError:  # an older confluent-kafka: the plain Producer, produce() returning at once
        control = Producer(conf)

        async def send(i: int) -> object:
            control.produce(args.topic, f"v-{i}".encode())
            return control.poll(0)

        await asyncio.gather(*(worker(send, lambda: len(control)) for _ in range(args.concurrency)))
        remaining = control.flush(60)
    else:
        aio = AIOProducer(conf)

        async def send(i: int) -> object:
            return await aio.produce(args.topic, f"v-{i}".encode())  # accepted; its delivery is a future

        await asyncio.gather(*(worker(send, lambda: len(aio)) for _ in range(args.concurrency)))
        await aio.flush()
        remaining = len(aio)
        await aio.close()
    _publish_pending(args.status, remaining)
    logging.info("flushed with %d undelivered", remaining)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["reliable", "control", "async", "async-control"], required=True)
    ap.add_argument("--bootstrap", help="the brokers of an open cluster (default: from the environment)")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--outbox")
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--end", type=int, required=True)
    ap.add_argument("--ledger", required=True)
    ap.add_argument("--status", help="file kept holding the number of accepted, undelivered messages")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=200, help="asyncio tasks sending at once (async modes)")
    ap.add_argument("--mix", action="store_true",
                    help="reliable mode: every other batch as one send() per message (the outbox's journal "
                         "path), the rest as send_many() (its SQLite path)")
    args = ap.parse_args()
    # Into the member log the tests keep per child: what each run started from and how it ended.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
    logging.info("%s producer: indexes %d..%d to %s", args.mode, args.start, args.end - 1, args.topic)

    connection = connection_from_env(args.bootstrap)
    if args.mode in ("async", "async-control"):
        return asyncio.run(_run_async(args, connection))
    ledger = open(args.ledger, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    if args.mode == "reliable":
        producer = ReliableProducer(
            {**connection, "linger.ms": 20}, outbox_path=args.outbox, preflight="off"
        )
        for start in range(args.start, args.end, args.batch):
            idx = range(start, min(start + args.batch, args.end))
            # The application's own id per value: re-sending a value it had not recorded as accepted
            # (killed between send_many() and the ledger write) carries the same rk-id as the original.
            if args.mix and (start // args.batch) % 2:
                for i in idx:
                    producer.send(args.topic, f"v-{i}".encode(), message_id=f"v-{i}")
                    ledger.write(f"{i}\n")
            else:
                producer.send_many([Message(args.topic, f"v-{i}".encode(), message_id=f"v-{i}") for i in idx])
                ledger.write("".join(f"{i}\n" for i in idx))
            _publish_pending(args.status, producer.pending)
        remaining = producer.close(timeout=60)
        _publish_pending(args.status, remaining)
        logging.info("closed with %d undelivered", remaining)
        return 0 if remaining == 0 else 3
    control = Producer({**connection, "acks": "all", "linger.ms": 20})
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
