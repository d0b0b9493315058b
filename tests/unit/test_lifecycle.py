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


def _threads() -> set[str]:
    import threading

    return {t.name for t in threading.enumerate()}


def test_producer_constructor_starts_nothing_and_start_close_are_idempotent() -> None:
    from reliable_kafka import ReliableProducer

    producer = ReliableProducer({"bootstrap.servers": "127.0.0.1:9"}, durability="memory", preflight="off")
    assert "reliable-kafka-producer" not in _threads()
    assert producer.start() is producer and producer.start() is producer
    assert "reliable-kafka-producer" in _threads()
    assert producer.close(timeout=0.1) == 0
    assert producer.close(timeout=0.1) == 0
    assert "reliable-kafka-producer" not in _threads()


def test_producer_first_send_starts_it_and_send_after_close_raises() -> None:
    from reliable_kafka import ProducerClosed, ReliableProducer

    with ReliableProducer({"bootstrap.servers": "127.0.0.1:9"}, durability="memory", preflight="off") as producer:
        assert "reliable-kafka-producer" in _threads()
    with pytest.raises(ProducerClosed):
        producer.send("orders", b"late")
    with pytest.raises(ClientClosed):
        producer.start()
    fresh = ReliableProducer({"bootstrap.servers": "127.0.0.1:9"}, durability="memory", preflight="off")
    fresh.send("orders", b"first")  # starts delivering on its own
    assert "reliable-kafka-producer" in _threads()
    assert fresh.close(timeout=0.1) == 1  # nothing listens: the message is still pending


def test_renamed_arguments_warn_and_conflicting_spellings_are_refused() -> None:
    from reliable_kafka import ConfigError, DeadLetterPolicy, ReliableProducer, RetryPolicy, TransactionalProcessor

    with pytest.warns(DeprecationWarning, match=r"send_timeout=\.\.\.\) is deprecated.*send_timeout_s"):
        ReliableProducer({"bootstrap.servers": "127.0.0.1:9"}, durability="memory", send_timeout=5.0).close(0.1)
    with pytest.raises(ConfigError, match="send_timeout"):
        ReliableProducer({"bootstrap.servers": "127.0.0.1:9"}, durability="memory", send_timeout=5.0,
                         send_timeout_s=6.0)
    base = {"bootstrap.servers": "127.0.0.1:9", "group.id": "g"}
    common = {"input_topics": ["in"], "transform": lambda msg: [], "transactional_id": "t"}
    with pytest.warns(DeprecationWarning, match=r"retry_policy=\.\.\.\) is deprecated.*retry="):
        TransactionalProcessor(base, retry_policy=RetryPolicy(attempts=2), **common)
    with pytest.warns(DeprecationWarning, match=r"dlq_topic=\.\.\.\) is deprecated.*dead_letter="):
        TransactionalProcessor(base, dlq_topic="{topic}.poison", **common)
    with pytest.raises(ConfigError, match="dlq_topic"):
        TransactionalProcessor(base, dlq_topic="{topic}.poison", dead_letter=DeadLetterPolicy("{topic}.bad"),
                               **common)


def test_processor_close_twice_is_harmless_and_start_after_close_raises_client_closed() -> None:
    from reliable_kafka import TransactionalProcessor

    processor = TransactionalProcessor({"bootstrap.servers": "127.0.0.1:9", "group.id": "g"}, input_topics=["in"],
                                       transform=lambda msg: [], transactional_id="t")
    processor.close()
    processor.close()
    with pytest.raises(ClientClosed, match="closed; create a new one"):
        processor.start()
