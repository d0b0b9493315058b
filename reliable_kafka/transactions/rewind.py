"""Rewinding the consumer: every owned partition sought back to its committed offset.

Guarantee: the positions returned are the committed (stable, KIP-447) offsets, so nothing past the last
committed transaction is skipped or done twice; offsets that cannot be read stop with TransactionFailed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from reliable_kafka import kafka_errors
from reliable_kafka.errors import TransactionFailed
from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.transactions.calls import Deadlines
from reliable_kafka.transactions.records import TopicPartitionKey

log = logging.getLogger("reliable_kafka.transactions")


def seek_to_committed(consumer: Consumer, owned: Iterable[TopicPartitionKey], *, deadlines: Deadlines,
                      reset_to: int) -> dict[TopicPartitionKey, int]:
    """Seek each partition to its committed offset (`reset_to` where none is); the committed offsets.

    Raises TransactionFailed when the committed offsets cannot be read within the retry deadline.
    """
    partitions = [TopicPartition(t, p) for t, p in sorted(owned)]
    try:
        # read_committed makes librdkafka ask for stable offsets (KIP-447): pending transactional
        # offsets are waited for, not skipped.
        committed = retry_kafka_call(
            lambda: consumer.committed(partitions, timeout=deadlines.timeout()),
            deadline_s=deadlines.retry_deadline(),
            what="read committed offsets",
            log=log,
        )
    except KafkaException as exc:
        raise TransactionFailed(
            "could not read the committed offsets to rewind after an abort "
            f"({kafka_errors.describe(exc)}); stopping rather than skip or repeat records",
            code=kafka_errors.name_of(exc),
        ) from exc
    positions: dict[TopicPartitionKey, int] = {}
    for tp in committed:
        if tp.offset >= 0:
            positions[(tp.topic, tp.partition)] = tp.offset
            target = tp.offset
        else:
            target = reset_to
        try:
            consumer.seek(TopicPartition(tp.topic, tp.partition, target))
        except KafkaException as exc:
            if kafka_errors.code_of(exc) != KafkaError._STATE:
                raise
            # Not fetching yet: it will start at its committed offset anyway.
            log.debug("%s[%d] not fetching yet; no seek needed", tp.topic, tp.partition)
    return positions
