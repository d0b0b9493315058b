"""Real parts for tests and labs: a local Kafka cluster, the librdkafka mock cluster, a redis-server.

Delivery, ordering and exactly-once claims are proven on LocalKafkaCluster only; MockCluster is for
client error paths (see its docstring for what it does not enforce).
"""

from reliable_kafka.testing.cluster import LocalKafkaCluster, consume_all, free_port
from reliable_kafka.testing.mock import MockCluster

__all__ = ["LocalKafkaCluster", "MockCluster", "consume_all", "free_port"]
