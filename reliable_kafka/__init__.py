"""reliable-kafka: Kafka clients that do not lose or duplicate messages.

The public API is what this module exports; everything else is internal.
"""

from reliable_kafka.errors import (
    ClusterUnreachable,
    CommitFailed,
    ConfigError,
    DeadLetterFailed,
    DedupStoreUnavailable,
    DeliveryFailed,
    OutboxCorrupt,
    OutboxError,
    OutboxFull,
    OutboxLocked,
    ProducerClosed,
    ReliableKafkaError,
    SerializationError,
    TopicConfigError,
    TransactionFenced,
)

__version__ = "0.1.0"

__all__ = [
    "ClusterUnreachable",
    "CommitFailed",
    "ConfigError",
    "DeadLetterFailed",
    "DedupStoreUnavailable",
    "DeliveryFailed",
    "OutboxCorrupt",
    "OutboxError",
    "OutboxFull",
    "OutboxLocked",
    "ProducerClosed",
    "ReliableKafkaError",
    "SerializationError",
    "TopicConfigError",
    "TransactionFenced",
]
