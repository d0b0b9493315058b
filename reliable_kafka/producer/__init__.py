"""The reliable producer: ReliableProducer (front.py), AsyncReliableProducer (aio.py, asyncio) and the parts
they compose, one job per module.

Guarantee: an accepted message leaves the outbox only on a delivery report that all in-sync replicas have it.
"""

from reliable_kafka.producer.aio import AsyncReliableProducer
from reliable_kafka.producer.front import ReliableProducer
from reliable_kafka.producer.messages import Headers, Message, Sent, Serializer

__all__ = ["AsyncReliableProducer", "Headers", "Message", "ReliableProducer", "Sent", "Serializer"]
