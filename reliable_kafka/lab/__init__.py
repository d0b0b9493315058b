"""The loss lab: classic Kafka loss scenarios run side by side for an unsafe control client and for
reliable_kafka, on a real cluster, with the lost and duplicated messages counted."""
