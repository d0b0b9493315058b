"""Redis dedup store against a real redis-server: the shared DedupStore contract, batches, and server faults.

A killed or hung server must raise DedupStoreUnavailable within the socket timeout; a restarted server
without persistence has forgotten its confirmations, so duplicates are caught only within what it remembers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from reliable_kafka.dedup import RedisDedupStore
from reliable_kafka.errors import ClusterError, DedupStoreUnavailable
from reliable_kafka.testing.redis_server import RedisServer
from tests.unit.test_dedup_sqlite import LEASE_S, PAST_LEASE_S, DedupStoreContract

pytestmark = pytest.mark.redis


@pytest.fixture
def make_store(redis_url: str) -> Iterator[Callable[..., RedisDedupStore]]:
    stores: list[RedisDedupStore] = []

    def make(**kwargs: Any) -> RedisDedupStore:
        store = RedisDedupStore(redis_url, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


class TestRedisDedupStoreContract(DedupStoreContract):
    pass


def _script_calls(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        stats = client.info("commandstats")
    return sum(int(stats.get(name, {}).get("calls", 0)) for name in ("cmdstat_evalsha", "cmdstat_eval"))


def test_a_batch_of_10k_keys_is_one_round_trip_and_fast(redis_url: str) -> None:
    keys = [f"order-{i:05d}" for i in range(10_000)]
    with RedisDedupStore(redis_url) as a, RedisDedupStore(redis_url) as b:
        a.claim(["warm-up"])  # the first call of each script also loads it
        a.confirm(["warm-up"])
        before = _script_calls(redis_url)
        started = time.monotonic()
        claimed = a.claim(keys)
        a.confirm(keys)
        elapsed = time.monotonic() - started
        assert _script_calls(redis_url) - before == 2, "claim and confirm must be one script call each"
        assert claimed.claimed == set(keys)
        assert b.claim(keys).done == set(keys)
    assert elapsed < 3.0, f"10k keys took {elapsed:.2f}s"


def test_keys_are_prefixed_strings_and_prefixes_isolate_stores(redis_url: str) -> None:
    with (
        RedisDedupStore(redis_url, prefix="app1:") as app1,
        RedisDedupStore(redis_url, prefix="app2:") as app2,
    ):
        app1.claim(["k"])
        app1.confirm(["k"])
        assert app2.claim(["k"]).claimed == {"k"}
        with redis.Redis.from_url(redis_url, decode_responses=True) as raw:
            assert raw.get("app1:k") == "done"
            assert raw.get("app2:k") == f"claim:{app2.owner}"
            assert 0 < raw.pttl("app1:k") <= 7 * 24 * 3600 * 1000


def test_a_callers_client_works_and_stays_open_after_close(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with RedisDedupStore(client) as store:
        assert store.claim(["k"]).claimed == {"k"}
        store.confirm(["k"])
        assert store.claim(["k"]).done == {"k"}
    assert client.ping()
    client.close()


def test_a_key_with_a_newline_is_refused(redis_url: str) -> None:
    with RedisDedupStore(redis_url) as store, pytest.raises(ValueError, match="newline"):
        store.claim(["a\nb"])


def test_an_unreachable_server_is_reported_at_construction(own_redis_server: RedisServer) -> None:
    url = own_redis_server.url
    own_redis_server.stop()
    started = time.monotonic()
    with pytest.raises(DedupStoreUnavailable, match=url):
        RedisDedupStore(url)
    assert time.monotonic() - started < 2.0


def test_a_killed_server_raises_unavailable_at_once_and_a_restart_forgets(
    own_redis_server: RedisServer,
) -> None:
    with RedisDedupStore(own_redis_server.url) as store:
        store.claim(["seen-1", "seen-2", "in-flight"])
        store.confirm(["seen-1", "seen-2"])
        own_redis_server.kill()

        for operation in (store.claim, store.confirm, store.release):
            started = time.monotonic()
            with pytest.raises(DedupStoreUnavailable, match="fail-closed"):
                operation(["seen-1"])
            assert time.monotonic() - started < 1.0, f"{operation.__name__} took too long to give up"

        own_redis_server.restart()
        # The server kept nothing on disk: the confirmations are gone, so a redelivery of these
        # messages would run again. Duplicates are caught only within what the store remembers.
        result = store.claim(["seen-1", "seen-2", "in-flight"])
        assert result.claimed == {"seen-1", "seen-2", "in-flight"}


def test_a_hung_server_raises_unavailable_within_the_socket_timeout(own_redis_server: RedisServer) -> None:
    with RedisDedupStore(own_redis_server.url, socket_timeout_s=0.5) as store:
        store.claim(["before"])
        own_redis_server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(DedupStoreUnavailable, match="Timeout"):
                store.claim(["during"], lease_s=LEASE_S)
            assert time.monotonic() - started < 2.0
        finally:
            own_redis_server.resume()
        # The unanswered claim may still have been applied after the resume; it only holds the key
        # until its lease runs out, never marks it done.
        time.sleep(PAST_LEASE_S)
        assert store.claim(["during"]).claimed == {"during"}


def test_an_evicting_memory_policy_is_warned_about(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    with redis.Redis.from_url(own_redis_server.url) as raw:
        raw.config_set("maxmemory-policy", "allkeys-lru")
    with (
        caplog.at_level(logging.WARNING, logger="reliable_kafka.dedup"),
        RedisDedupStore(own_redis_server.url),
    ):
        pass
    assert any("maxmemory-policy=allkeys-lru" in record.getMessage() for record in caplog.records)


def test_the_harness_reports_a_taken_port_and_a_missing_binary(redis_server: RedisServer) -> None:
    with pytest.raises(ClusterError, match="exited with code"), RedisServer(port=redis_server.port):
        pass
    with pytest.raises(ClusterError, match="not on PATH"), RedisServer(binary="no-such-redis-server"):
        pass
    assert redis_server.pid is not None, "the server already on that port was not touched"
