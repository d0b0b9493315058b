"""Failure handling inside a transaction: a failing transform is retried (RetryPolicy), then its input is
dead-lettered in the same transaction; an input whose outputs Kafka refused for good is dead-lettered next time.

Guarantee: an input record leaves the processor either as its outputs or as its dead-letter copy, never
neither: both are written in the transaction that commits its offset.
"""

from __future__ import annotations

import logging
import threading

from confluent_kafka import KafkaException, Message

from reliable_kafka import kafka_errors
from reliable_kafka.dlq import dead_letter_headers, dlq_topic_for
from reliable_kafka.errors import DeadLetterFailed, RetriesExhausted
from reliable_kafka.ids import ID_HEADER
from reliable_kafka.kafka_errors import Disposition
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.transactions.records import (
    OUT_DEAD,
    OUT_INPUT,
    OUT_INPUT_OFFSET,
    OUT_TOPIC,
    Out,
    OutputRecord,
    Outputs,
    TopicPartitionKey,
    Transform,
    check_output,
    has_id,
    input_headers,
    input_id,
    label,
    where,
)

log = logging.getLogger("reliable_kafka.transactions")


class TransformFailures:
    """The retry → dead-letter stages of the processor, and the inputs waiting to be dead-lettered.

    `refused` maps (topic, partition, offset) of an input whose outputs were refused for good to the
    error and attempts its dead-letter copy carries; the batch loop looks it up only when it is not empty.
    """

    def __init__(self, transform: Transform, retry: RetryPolicy, dlq_template: str, input_topics: list[str],
                 stopping: threading.Event) -> None:
        self._transform = transform
        self._retry = retry
        self._template = dlq_template
        self._dlq_topics = {t: dlq_topic_for(t, dlq_template) for t in input_topics}
        self._stopping = stopping
        self.refused: dict[tuple[str, int, int], tuple[BaseException, int]] = {}

    def after_failure(self, msg: Message, first: Exception) -> tuple[Outputs, bool]:
        """Retry a failed transform per the retry policy; a poison record becomes its dead-letter record.

        Only a failure pays for the retry machinery: the policy replays `first` as the first attempt, so
        the transform still runs at most `attempts` times in all.
        """

        def attempt() -> list[OutputRecord]:
            outputs = list(self._transform(msg))
            for out in outputs:
                check_output(out)
            return outputs

        try:
            return self._retry.run(attempt, stop_event=self._stopping, label=label(msg), first_error=first), False
        except RetriesExhausted as exc:
            log.error("%s is poison after %d attempt(s): %r; dead-lettering it",
                      label(msg), exc.attempts, exc.last_error)
            return [self.dead_letter(msg, exc.last_error, exc.attempts)], True

    def dead_letter(self, msg: Message, error: BaseException, attempts: int) -> OutputRecord:
        """The input's dead-letter record: its value and key, its headers plus the dead-letter headers."""
        topic, partition, offset = where(msg)
        dlq = self._dlq_topics.get(topic)
        if dlq is None:
            dlq = self._dlq_topics[topic] = dlq_topic_for(topic, self._template)
        original = input_headers(msg)
        if not has_id(original):
            original.append((ID_HEADER, input_id(msg, (topic, partition), offset)))
        kind, stamp = msg.timestamp()
        headers = dead_letter_headers(
            topic=topic,
            partition=partition,
            offset=offset,
            timestamp_ms=stamp if kind else None,
            error=error,
            attempts=attempts,
            original_headers=original,
        )
        return OutputRecord(dlq, msg.value(), msg.key(), headers)

    def output_refused(self, out: Out, exc: KafkaException) -> DeadLetterFailed | None:
        """produce() refused an output (the transaction is aborted next). If Kafka will never take it, the
        input is dead-lettered on its way round again; if it was the dead-letter copy, the error to stop with."""
        if kafka_errors.classify(exc) is not Disposition.PERMANENT:
            return None
        (in_topic, in_partition), in_offset = out[OUT_INPUT], out[OUT_INPUT_OFFSET]
        where_ = f"{in_topic}[{in_partition}]@{in_offset}"
        if out[OUT_DEAD]:
            return DeadLetterFailed(
                f"{where_} could not be written to dead-letter topic {out[OUT_TOPIC]!r}: "
                f"{kafka_errors.describe(exc)}; its offset was not committed"
            )
        # Some outputs of this input may already be in the transaction: it is all aborted, and on the
        # way round again the input is parked on its dead-letter topic instead of transformed.
        self.refused[(in_topic, in_partition, in_offset)] = (exc, 1)
        log.error("%s: output to %r refused for good (%s); the input will be dead-lettered",
                  where_, out[OUT_TOPIC], kafka_errors.describe(exc))
        return None

    def forget(self, gone: set[TopicPartitionKey]) -> None:
        """Partitions went to another member: their refused inputs are its to handle."""
        for k in [k for k in self.refused if (k[0], k[1]) in gone]:
            del self.refused[k]
