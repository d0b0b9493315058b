"""One lifecycle rule for every client (docs/api.md#lifecycle): the constructor checks and opens, start()
begins the work (with, and the first call that needs it, call it), close() is idempotent."""

from __future__ import annotations

import pytest

from reliable_kafka import ClientClosed, ReliableConsumer

# Nothing listens here: the consumer's constructor and start() must not need a broker.
_NOWHERE = {"bootstrap.servers": "127.0.0.1:9", "group.id": "lifecycle"}


def test_consumer_start_is_idempotent_and_close_twice_is_harmless() -> None:
    consumer = ReliableConsumer(_NOWHERE, ["orders"])
    assert consumer.start() is consumer
    assert consumer.start() is consumer
    consumer.close(timeout=1)
    consumer.close(timeout=1)


def test_consumer_used_after_close_raises_client_closed() -> None:
    consumer = ReliableConsumer(_NOWHERE, ["orders"])
    consumer.close(timeout=1)
    with pytest.raises(ClientClosed, match="closed; create a new one"):
        consumer.poll(0)


def test_consumer_with_block_starts_and_closes() -> None:
    with ReliableConsumer(_NOWHERE, ["orders"]) as consumer:
        assert consumer.poll(0) is None
    with pytest.raises(ClientClosed):
        consumer.start()
