"""Real parts for tests and labs: a local Kafka cluster, a Spark standalone cluster, the librdkafka mock
cluster, a redis-server.

Delivery, ordering and exactly-once claims are proven on LocalKafkaCluster only; MockCluster is for
client error paths (see its docstring for what it does not enforce).
"""

from reliable_kafka.testing.cluster import LocalKafkaCluster, consume_all, free_port
from reliable_kafka.testing.mock import MockCluster
from reliable_kafka.testing.spark_cluster import LocalSparkCluster

__all__ = ["LocalKafkaCluster", "LocalSparkCluster", "MockCluster", "consume_all", "free_port"]
