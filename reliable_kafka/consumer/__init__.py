"""The reliable consumer: ReliableConsumer (front.py), AsyncReliableConsumer (aio.py) and the parts they compose.

Guarantee: an offset is committed only when it and every earlier offset of its partition were processed.
"""

from reliable_kafka.consumer.aio import AsyncReliableConsumer
from reliable_kafka.consumer.commits import CommitPolicy
from reliable_kafka.consumer.dedup_stage import DedupPolicy, KeyFunction
from reliable_kafka.consumer.front import ReliableConsumer
from reliable_kafka.consumer.work import AsyncHandler, BatchHandler, Handler
from reliable_kafka.dlq import DeadLetterPolicy

__all__ = ["AsyncHandler", "AsyncReliableConsumer", "BatchHandler", "CommitPolicy", "DeadLetterPolicy", "DedupPolicy",
           "Handler", "KeyFunction", "ReliableConsumer"]
