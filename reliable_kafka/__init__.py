"""reliable-kafka: Kafka clients that do not lose or duplicate messages.

The public API is what this module exports; everything else is internal.
"""

from typing import TYPE_CHECKING

from reliable_kafka.admin import ensure_topic
from reliable_kafka.consumer import (
    AsyncReliableConsumer,
    CommitPolicy,
    DeadLetterPolicy,
    DedupPolicy,
    ReliableConsumer,
)
from reliable_kafka.dedup import ClaimResult, DedupStore, SQLiteDedupStore
from reliable_kafka.errors import (
    AuthenticationFailed,
    AuthorizationFailed,
    ClientClosed,
    ClusterAuthorizationFailed,
    ClusterError,
    ClusterUnreachable,
    CommitFailed,
    ConfigError,
    DeadLetterFailed,
    DedupStoreUnavailable,
    DeliveryFailed,
    DeserializationError,
    GroupAuthorizationFailed,
    InputRefused,
    MissingExtra,
    OutboxCorrupt,
    OutboxError,
    OutboxFull,
    OutboxLocked,
    PartitionFenced,
    PartitionWriteFailed,
    ProducerClosed,
    ReadIncomplete,
    RefusedByKafka,
    ReliableKafkaError,
    RetriesExhausted,
    RetryInterrupted,
    SerializationError,
    TopicAuthorizationFailed,
    TopicConfigError,
    TopicMissing,
    TransactionalIdAuthorizationFailed,
    TransactionFailed,
    TransactionFenced,
    Unavailable,
    WriteRefused,
    WrongEventLoop,
)
from reliable_kafka.producer import AsyncReliableProducer, Message, ReliableProducer, Sent
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.spool import Durability, OutboxRow
from reliable_kafka.stats import Stats
from reliable_kafka.transactions import MapValues, OutputRecord, TransactionalProcessor

if TYPE_CHECKING:
    from reliable_kafka.dedup.redis import RedisDedupStore

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # Optional extras are imported on first use, so `import reliable_kafka` needs none of them.
    if name == "RedisDedupStore":
        from reliable_kafka.dedup.redis import RedisDedupStore

        return RedisDedupStore
    raise AttributeError(f"module 'reliable_kafka' has no attribute {name!r}")


__all__ = [
    "AsyncReliableConsumer",
    "AsyncReliableProducer",
    "ClaimResult",
    "CommitPolicy",
    "DeadLetterPolicy",
    "DedupPolicy",
    "DedupStore",
    "Durability",
    "MapValues",
    "Message",
    "OutboxRow",
    "OutputRecord",
    "ReliableConsumer",
    "RedisDedupStore",
    "ReliableProducer",
    "ensure_topic",
    "RetryPolicy",
    "SQLiteDedupStore",
    "Sent",
    "Stats",
    "TransactionalProcessor",
    # errors (the tree is drawn in reliable_kafka/errors.py)
    "ClusterError",
    "ClusterUnreachable",
    "CommitFailed",
    "ConfigError",
    "DeadLetterFailed",
    "DedupStoreUnavailable",
    "DeliveryFailed",
    "DeserializationError",
    "InputRefused",
    "MissingExtra",
    "OutboxCorrupt",
    "OutboxError",
    "OutboxFull",
    "OutboxLocked",
    "PartitionFenced",
    "PartitionWriteFailed",
    "AuthenticationFailed",
    "AuthorizationFailed",
    "ClientClosed",
    "ClusterAuthorizationFailed",
    "GroupAuthorizationFailed",
    "ProducerClosed",
    "ReadIncomplete",
    "RefusedByKafka",
    "ReliableKafkaError",
    "RetriesExhausted",
    "RetryInterrupted",
    "SerializationError",
    "TopicConfigError",
    "TopicAuthorizationFailed",
    "TopicMissing",
    "TransactionFailed",
    "TransactionFenced",
    "TransactionalIdAuthorizationFailed",
    "Unavailable",
    "WriteRefused",
    "WrongEventLoop",
]
