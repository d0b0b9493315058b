"""An order API on FastAPI that answers 200 only once the order's Kafka message is durable.

Guarantees shown here (see docs/services.md and docs/producer.md):

* `POST /orders` returns 200 only after `await producer.send()` returned: the message is then in the
  outbox (durability "process"), and it reaches Kafka even if this worker is SIGKILLed right after the
  response left. The worker uvicorn starts in its place claims the dead worker's outbox slot and sends it
  first; if the deployment restarts with fewer workers, a remaining worker adopts the orphaned slot.
* Every uvicorn worker opens its own AsyncReliableProducer on the same `outbox_dir` (one slot file per
  live worker, under its lock): `--workers 3` needs no per-worker configuration.
* The order id is the message id (`rk-id: order-<id>`): a client that retries a request whose answer it
  never got publishes the same rk-id again, and a consumer with dedup applies the order once.
* A small audit consumer (ReliableConsumer, group `RK_GROUP`) runs in a thread that the lifespan starts
  and stops; `GET /stats` shows what this worker sent and audited.

Run it (the same outbox directory for every worker, on a local disk kept across restarts):

    RK_BOOTSTRAP_SERVERS=B RK_OUTBOX_DIR=/var/lib/orders/outbox uvicorn examples.fastapi_service:app --workers 3

or `python examples/fastapi_service.py --bootstrap-servers B --outbox-dir DIR --workers 3 --create-topic`.
Settings come from the environment (RK_BOOTSTRAP_SERVERS, RK_OUTBOX_DIR, RK_TOPIC, RK_GROUP; an empty
RK_GROUP runs no consumer), or from `create_app(Settings(...))` when you build the app yourself.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Message
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel, Field

from reliable_kafka import (
    AsyncReliableProducer,
    DeliveryFailed,
    OutboxFull,
    ProducerClosed,
    ReliableConsumer,
    TopicConfigError,
    ensure_topic,
)

log = logging.getLogger("fastapi_service")


@dataclass(frozen=True)
class Settings:
    bootstrap_servers: str
    outbox_dir: str
    topic: str = "orders"
    group: str | None = "order-audit"  # None: no audit consumer
    close_timeout_s: float = 20.0  # what shutdown gives pending messages; the rest stays in the outbox

    @classmethod
    def from_env(cls) -> Settings:
        missing = [name for name in ("RK_BOOTSTRAP_SERVERS", "RK_OUTBOX_DIR") if not os.environ.get(name)]
        if missing:
            raise RuntimeError(f"set {' and '.join(missing)}: the Kafka bootstrap servers and the outbox directory "
                               "every worker shares (a local disk kept across restarts)")
        return cls(bootstrap_servers=os.environ["RK_BOOTSTRAP_SERVERS"], outbox_dir=os.environ["RK_OUTBOX_DIR"],
                   topic=os.environ.get("RK_TOPIC", "orders"), group=os.environ.get("RK_GROUP", "order-audit") or None)


class Order(BaseModel):
    id: str = Field(min_length=1, max_length=100)
    customer: str = Field(min_length=1, max_length=100)
    total: float


class OrderAudit:
    """The consumer side: a ReliableConsumer counting the orders it sees, in a thread of its own.

    AsyncReliableConsumer is on its way; once it is in the package this thread becomes a task on the loop.
    """

    def __init__(self, settings: Settings, group: str) -> None:
        self.audited = 0
        self._consumer = ReliableConsumer({"bootstrap.servers": settings.bootstrap_servers, "group.id": group},
                                          [settings.topic])
        self._thread = threading.Thread(target=self._consumer.run, args=(self._handle,), name="order-audit",
                                        daemon=True)

    def _handle(self, msg: Message) -> None:
        self.audited += 1  # a real audit would write somewhere: raise to retry, then dead-letter

    def start(self) -> OrderAudit:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._consumer.stop()  # in-flight records finish and are committed
        self._thread.join(30)
        self._consumer.close()


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; `settings=None` reads them from the environment when a worker starts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        s = settings or Settings.from_env()
        # One producer per worker process; outbox_dir gives each its own slot file in the shared directory
        # and drains the slots of workers that died or were retired.
        producer = AsyncReliableProducer({"bootstrap.servers": s.bootstrap_servers}, outbox_dir=s.outbox_dir,
                                         durability="process")
        await producer.start()  # what an earlier worker left in the claimed slot goes out first
        audit = OrderAudit(s, s.group).start() if s.group else None
        app.state.producer, app.state.topic, app.state.audit = producer, s.topic, audit
        try:
            yield
        finally:
            if audit is not None:
                audit.stop()
            left = await producer.close(timeout=s.close_timeout_s)
            if left:
                log.warning("%d order(s) not delivered yet at shutdown: they stay in the outbox slot and go out "
                            "with the next worker", left)

    app = FastAPI(title="orders", lifespan=lifespan)

    @app.post("/orders")
    async def create_order(order: Order, request: Request) -> dict[str, Any]:
        producer: AsyncReliableProducer = request.app.state.producer
        try:
            sent = await producer.send(request.app.state.topic, order.model_dump_json().encode(),
                                       key=order.customer.encode(), message_id=f"order-{order.id}")
        except (OutboxFull, ProducerClosed) as exc:  # not accepted: the client may retry (same id)
            raise HTTPException(503, f"order {order.id} not accepted, retry later: {exc}",
                                headers={"Retry-After": "1"}) from exc
        except DeliveryFailed as exc:  # Kafka refused it for good; it is kept in the outbox as failed
            raise HTTPException(502, f"order {order.id} refused by Kafka: {exc.reason}") from exc
        except TopicConfigError as exc:  # the topic is missing or cannot keep acks=all durable
            raise HTTPException(500, f"order {order.id} not accepted: {exc}") from exc
        # Here the order is durable in the outbox: a 200 is a promise that it reaches Kafka.
        return {"order_id": order.id, "message_id": sent.message_id, "worker": os.getpid()}

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        audit: OrderAudit | None = request.app.state.audit
        return {"worker": os.getpid(), "producer": dict(request.app.state.producer.stats()),
                "audited": None if audit is None else audit.audited}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"worker": os.getpid()}

    return app


app = create_app()


def main() -> int:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--outbox-dir", required=True, help="shared by every worker; a local disk kept across restarts")
    ap.add_argument("--topic", default="orders")
    ap.add_argument("--group", default="order-audit", help="the audit consumer's group ('' for none)")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--create-topic", action="store_true", help="create the topic (3 replicas, min ISR 2) if missing")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    if args.create_topic:
        ensure_topic({"bootstrap.servers": args.bootstrap_servers}, args.topic)
    # The workers are separate processes that import this module: they read their settings from here.
    os.environ.update(RK_BOOTSTRAP_SERVERS=args.bootstrap_servers, RK_OUTBOX_DIR=args.outbox_dir,
                      RK_TOPIC=args.topic, RK_GROUP=args.group)
    uvicorn.run("fastapi_service:app", app_dir=str(Path(__file__).parent), host=args.host, port=args.port,
                workers=args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
