"""The reliable producer: ReliableProducer (front.py) and the parts it composes, one job per module.

Guarantee: an accepted message leaves the outbox only on a delivery report that all in-sync replicas have it.
"""

from reliable_kafka.producer.front import ReliableProducer
from reliable_kafka.producer.messages import Headers, Message, Sent, Serializer

__all__ = ["Headers", "Message", "ReliableProducer", "Sent", "Serializer"]
