"""AsyncReliableProducer and group commit against the real cluster: concurrent sends share outbox
transactions and every acknowledged message is delivered once, through a SIGKILL under load too.

The SIGKILL scenario runs the same child on confluent-kafka's own asyncio producer to show the fault bites.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from reliable_kafka import AsyncReliableProducer, ReliableProducer
from reliable_kafka.testing import LocalKafkaCluster, consume_all
from reliable_kafka.testing.verify import verdict
from tests.fixtures.members import MemberLogs
from tests.integration.test_producer import _run_killed

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("durability", ["process", "memory"])
def test_200_concurrent_async_sends_are_delivered_once_in_shared_commits(kafka: LocalKafkaCluster, make_topic,
                                                                        tmp_path: Path, durability: str) -> None:
    """"process": the writer thread commits what the tasks queued; "memory": a loop pass's sends are
    accepted together on the loop."""
    topic = make_topic(partitions=3)
    values = [f"a-{task}-{i}".encode() for task in range(200) for i in range(10)]
    outbox = tmp_path / "o.db" if durability == "process" else None

    async def main() -> tuple[int, int, list[str]]:
        async with AsyncReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, durability=durability,
                                         outbox_path=outbox) as p:

            async def task(n: int) -> list[object]:
                return [await p.send(topic, v) for v in values[n * 10:(n + 1) * 10]]

            sent = [s for batch in await asyncio.gather(*(task(n) for n in range(200))) for s in batch]
            outcomes = await asyncio.gather(*(p.wait(s, 60) for s in sent[:50]))  # type: ignore[arg-type]
            assert await p.flush(60) == 0
            stats = p.stats()
        return stats.sent, stats.commits, list(outcomes)

    sent, commits, outcomes = asyncio.run(main())
    assert sent == len(values)
    assert commits < sent, f"{commits} outbox transactions for {sent} messages: nothing was combined"
    assert outcomes == ["delivered"] * 50
    v = verdict(values, [m.value() for m in consume_all(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (len(values), 0, 0), v


@pytest.mark.parametrize("durability", ["process", "fsync", "memory"])
def test_16_threads_sending_one_by_one_lose_nothing_and_fsync_shares_commits(
        kafka: LocalKafkaCluster, make_topic, tmp_path: Path, durability: str) -> None:
    """"process": each send() is a record of the outbox's journal, on its own thread; "memory": each is
    accepted on its own thread too; "fsync": concurrent send() calls share outbox transactions (group
    commit)."""
    topic = make_topic(partitions=3)
    values = [f"s-{t}-{i}".encode() for t in range(16) for i in range(200)]
    outbox = None if durability == "memory" else tmp_path / "o.db"
    with ReliableProducer({"bootstrap.servers": kafka.bootstrap_servers}, outbox_path=outbox,
                          durability=durability) as p:
        p.check_topics([topic])

        def thread(t: int) -> None:
            for v in values[t * 200:(t + 1) * 200]:
                p.send(topic, v)

        threads = [threading.Thread(target=thread, args=(t,)) for t in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        assert p.flush(60) == 0
        stats = p.stats()
    assert stats.sent == len(values)
    if durability == "fsync":
        assert stats.commits < stats.sent, stats
    else:
        assert stats.commits == stats.sent, f"{durability}: each send() accepted on its own, {stats}"
    v = verdict(values, [m.value() for m in consume_all(kafka.bootstrap_servers, topic)])
    assert (v.acked, v.lost, v.duplicates) == (len(values), 0, 0), v


@pytest.mark.slow
def test_async_producer_sigkilled_under_load_loses_no_acknowledged_send_while_aioproducer_loses(
        kafka: LocalKafkaCluster, make_topic, tmp_path: Path, member_logs: MemberLogs) -> None:
    """A child with 200 tasks awaiting send() (process mode) records each acknowledged payload (fsynced);
    it is SIGKILLed twice once enough more were acknowledged and some are undelivered, and each next run
    on the same outbox re-sends what was pending first. The control child records a payload when
    `await produce()` of confluent-kafka's AIOProducer (acks=all) returned, and is killed the same way."""
    ours_topic = make_topic(partitions=3)
    control_topic = make_topic(partitions=3)
    accepted, kills = _run_killed("async", kafka, ours_topic, tmp_path, 12_000, kills=2, seed=11,
                                  member_logs=member_logs)
    assert kills == 2
    v = verdict([f"v-{i}".encode() for i in accepted],
                [m.value() for m in consume_all(kafka.bootstrap_servers, ours_topic)])
    assert v.lost == 0, v

    c_accepted, c_kills = _run_killed("async-control", kafka, control_topic, tmp_path, 40_000, kills=2, seed=12,
                                      member_logs=member_logs)
    control = verdict([f"v-{i}".encode() for i in c_accepted],
                      [m.value() for m in consume_all(kafka.bootstrap_servers, control_topic)])
    assert c_kills >= 1, "the control child was never killed mid-stream"
    assert control.lost > 0, f"killing the AIOProducer child lost nothing: {control}"
