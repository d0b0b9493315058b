"""The `service-crash` lab's machinery without Kafka: uvicorn workers of the lab's service, on a cluster
nobody can reach, SIGKILLed under HTTP load and the server restarted with a worker fewer. With no broker
nothing is delivered, so every request answered 200 must still be pending in the outbox pool."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from reliable_kafka.extras import missing_modules
from reliable_kafka.lab.service_crash import LoadGenerator, Service, inject
from reliable_kafka.outbox.front import Outbox
from reliable_kafka.outbox.pool import pool_status
from tests.fixtures.requirements import missing

# waits: its seconds go to starting, loading and SIGKILLing uvicorn workers, not to code that differs
# between Pythons; `./dev pythons` (the unit tier on 3.10 and 3.13) leaves it out to stay in the budget.
pytestmark = pytest.mark.waits

UNREACHABLE = "127.0.0.1:1"


def test_every_200_of_sigkilled_workers_is_pending_in_the_outbox_pool(tmp_path: Path) -> None:
    absent = missing_modules("services")
    if absent:
        missing(", ".join(absent), "pip install 'reliable-kafka[services]' (./dev setup installs every extra)")
    service = Service("reliable", UNREACHABLE, "orders", tmp_path, tmp_path / "service.log")
    load = LoadGenerator(service.url, "r", 16)
    try:
        service.start(3)
        service.wait_serving(3)
        load.start()
        done = inject(service, load, faults=("worker", "restart", "worker"), between=(100, 200), margin=1,
                      rng=random.Random(3), what="service-crash without Kafka")
        load.stop()
    finally:
        if load.running:
            load.stop()
        service.kill()  # SIGKILL again: nothing is closed, the pool keeps what the workers held
    assert done.kills == 2 and done.held >= 3, done
    assert "restarted with 2 worker(s)" in done.notes[0], done.notes

    slots = pool_status(tmp_path / "outbox")
    assert len(slots) == 3, "the first server's three workers each claimed a slot; the restart added none"
    pending: list[bytes] = []
    for slot in slots:
        with Outbox(slot.path, read_only=True) as outbox:
            pending += [row.value for row in outbox.iter_pending()]
    acked = set(load.acked)
    assert len(acked) == len(load.acked) >= 400
    assert acked <= set(pending), f"{len(acked - set(pending))} requests answered 200 are not in the pool"
