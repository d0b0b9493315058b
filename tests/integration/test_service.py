"""Web services on a real uvicorn server with several worker processes, against the real cluster.

The FastAPI example answers 200 only once a message is durable: every 200 is in the topic, once. The
`service-crash` lab scenario SIGKILLs workers under HTTP load: no 200-acknowledged request is lost, while
the same service on confluent-kafka's AIOProducer loses what it had buffered.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from reliable_kafka.errors import OutboxError
from reliable_kafka.extras import missing_modules
from reliable_kafka.ids import message_id_of
from reliable_kafka.lab.base import CONTROL, RELIABLE, no_progress
from reliable_kafka.lab.service_crash import free_port, service_crash
from reliable_kafka.outbox.pool import SlotStatus, pool_status
from reliable_kafka.testing import LocalKafkaCluster, consume_all
from reliable_kafka.testing.gates import wait_for
from reliable_kafka.testing.verify import verdict
from tests.fixtures.members import MemberLogs
from tests.fixtures.requirements import missing

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _services_extra() -> None:
    absent = missing_modules("services")
    if absent:
        missing(", ".join(absent), "pip install 'reliable-kafka[services]' (./dev setup installs every extra)")


def _slots(outbox_dir: Path) -> list[SlotStatus]:
    try:
        return pool_status(outbox_dir)
    except OutboxError:  # not created yet
        return []


def _serving(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.TransportError:
        return False


async def _post_orders(url: str, ids: list[int], concurrency: int) -> list[tuple[int, dict[str, Any]]]:
    import httpx

    queue = list(reversed(ids))
    answers: list[tuple[int, dict[str, Any]]] = []

    async def client_task(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            r = await client.post("/orders", json={"id": str(i), "customer": f"c-{i % 7}", "total": i / 4})
            answers.append((r.status_code, r.json()))

    # No keep-alive: each request is a new connection, so all three workers take their part.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60.0) as client:
        await asyncio.gather(*(client_task(client) for _ in range(concurrency)))
    return answers


def test_fastapi_example_on_three_uvicorn_workers_puts_every_200_in_the_topic_once(
        kafka: LocalKafkaCluster, make_topic, tmp_path: Path, member_logs: MemberLogs) -> None:
    topic = make_topic(partitions=3, configs={"min.insync.replicas": 2})
    outbox_dir = tmp_path / "outbox"
    port = free_port()
    env = {**os.environ, "RK_BOOTSTRAP_SERVERS": kafka.bootstrap_servers, "RK_OUTBOX_DIR": str(outbox_dir),
           "RK_TOPIC": topic, "RK_GROUP": f"audit-{uuid.uuid4().hex[:6]}"}
    orders = list(range(1, 301))
    with open(member_logs.path("fastapi-service"), "ab") as out:
        # As the user runs it: uvicorn's own command line, three workers sharing one outbox_dir.
        server = subprocess.Popen([sys.executable, "-m", "uvicorn", "examples.fastapi_service:app", "--workers", "3",
                                   "--host", "127.0.0.1", "--port", str(port)],
                                  cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Each worker owns a slot of the shared directory as soon as its lifespan opened its producer.
        assert wait_for(lambda: sum(s.locked for s in _slots(outbox_dir)) == 3, timeout_s=90, poll_s=0.2), \
            f"three workers did not each claim an outbox slot: {_slots(outbox_dir)}"
        owners = {s.owner_pid for s in _slots(outbox_dir)}
        # The shared socket listens once a worker's lifespan finished starting (uvicorn binds it in the master).
        assert wait_for(lambda: _serving(f"http://127.0.0.1:{port}/health"), timeout_s=60, poll_s=0.2)
        answers = asyncio.run(_post_orders(f"http://127.0.0.1:{port}", orders, concurrency=16))
        assert [code for code, _ in answers] == [200] * len(orders), [a for a in answers if a[0] != 200][:3]
        served_by = {body["worker"] for _, body in answers}
        assert served_by <= owners, (served_by, owners)
        print(f"{len(orders)} orders served by workers {sorted(served_by)} of {sorted(owners)}")
    finally:
        server.send_signal(signal.SIGTERM)  # uvicorn's graceful stop: each lifespan closes its producer
        try:
            server.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # the master still runs: only its own process group
            server.wait()
    assert server.returncode == 0, f"uvicorn exited {server.returncode}"
    assert [s.pending for s in _slots(outbox_dir)] == [0, 0, 0], "the shutdown left messages in the outbox"

    msgs = list(consume_all(kafka.bootstrap_servers, topic))
    v = verdict([str(i).encode() for i in orders], [json.loads(m.value())["id"].encode() for m in msgs])
    assert (v.acked, v.lost, v.duplicates) == (len(orders), 0, 0), v
    assert sorted(message_id_of(m.headers()) for m in msgs) == sorted(f"order-{i}" for i in orders)


@pytest.mark.slow
def test_service_crash_loses_no_200_acknowledged_request_while_the_aioproducer_service_loses(
        kafka: LocalKafkaCluster, member_logs: MemberLogs) -> None:
    """The lab scenario with smaller counts: a worker SIGKILLed, the whole server SIGKILLed and started
    with 2 workers instead of 3 (its third slot orphaned), a worker SIGKILLed again, each once 150-300
    more requests got a 200 and the victim held unconfirmed messages; an independent read_committed reader."""
    results = {r.client: r for r in service_crash(kafka, no_progress, faults=("worker", "restart", "worker"),
                                                 between=(150, 300), log_path=member_logs.path("service"))}
    ours, control = results[RELIABLE], results[CONTROL]
    print(ours, control, sep="\n")
    assert ours.acked > 0 and (ours.lost, ours.duplicates_after_dedup) == (0, 0), ours
    assert control.lost > 0, f"killing the AIOProducer service's workers lost nothing: {control}"
