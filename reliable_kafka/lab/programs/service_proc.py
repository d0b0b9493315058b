"""The web service of the `service-crash` lab: each `POST /send?id=ID` publishes one message (value and
rk-id: ID) and answers 200 once its client said the message was accepted; uvicorn runs it with workers.

RK_LAB_MODE picks the client. "reliable": AsyncReliableProducer on the outbox pool RK_LAB_OUTBOX_DIR, so
a 200 means the message is durable in the worker's slot. "control": confluent-kafka's AIOProducer with
acks=all, answering once `await produce()` returned, as services built on it do: the message is then in
its buffer, and its delivery a future nobody awaits. Every worker keeps RK_LAB_STATUS_DIR/worker-<pid>.json
(replaced atomically every 50 ms) saying its pid, its parent's and how many accepted messages it holds
unconfirmed, so the lab can aim a SIGKILL at a worker that holds some. The connection settings (the lab's
login on a secured cluster) come in the environment, see testing.child_connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Response

from reliable_kafka import AsyncReliableProducer
from reliable_kafka.testing.child_connection import connection_from_env

log = logging.getLogger("reliable_kafka.lab.service")

STATUS_EVERY_S = 0.05


def status_path(status_dir: str | os.PathLike[str], pid: int) -> Path:
    return Path(status_dir) / f"worker-{pid}.json"


def _publish(path: Path, unconfirmed: int, accepted: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "unconfirmed": unconfirmed,
                               "accepted": accepted}))
    os.replace(tmp, path)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    mode, connection, topic = os.environ["RK_LAB_MODE"], connection_from_env(), os.environ["RK_LAB_TOPIC"]
    status = status_path(os.environ["RK_LAB_STATUS_DIR"], os.getpid())
    accepted = 0
    send: Callable[[str], Awaitable[object]]
    unconfirmed: Callable[[], Awaitable[int]]
    close: Callable[[], Awaitable[object]]
    if mode == "reliable":
        producer = AsyncReliableProducer(connection, outbox_dir=os.environ["RK_LAB_OUTBOX_DIR"])
        await producer.start()

        async def send(rid: str) -> object:
            return await producer.send(topic, rid.encode(), message_id=rid)

        async def unconfirmed() -> int:
            return await asyncio.to_thread(lambda: producer.sync.pending)  # an outbox query: off the loop

        async def close() -> object:
            return await producer.close(timeout=30)
    else:
        from confluent_kafka.aio import AIOProducer

        aio = AIOProducer({**connection, "acks": "all"})

        async def send(rid: str) -> object:
            return await aio.produce(topic, rid.encode())  # buffered; the delivery is a future

        async def unconfirmed() -> int:
            return len(aio)  # its buffer plus what librdkafka holds

        async def close() -> object:
            await aio.close()  # flushes
            return None

    async def publish_status() -> None:
        while True:
            _publish(status, await unconfirmed(), accepted)
            await asyncio.sleep(STATUS_EVERY_S)

    async def handle(rid: str) -> Response:
        nonlocal accepted
        await send(rid)
        accepted += 1
        return Response(status_code=200)

    app.state.handle = handle
    publisher = asyncio.create_task(publish_status())
    log.info("%s worker %d serving, status in %s", mode, os.getpid(), status)
    try:
        yield
    finally:
        publisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publisher
        await close()
        status.unlink(missing_ok=True)  # a worker that stopped by itself holds nothing


app = FastAPI(lifespan=lifespan)


@app.post("/send")
async def send_one(id: str) -> Response:
    handle: Callable[[str], Awaitable[Response]] = app.state.handle
    return await handle(id)
