"""TransactionalClient: the processor's transactional producer, made, initialised, replaced and released.

Guarantee: a producer is handed out only after its init_transactions went through (which fences an earlier
incarnation of the transactional.id and settles what it left open), and a replaced one is purged first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from reliable_kafka import kafka_errors, rdkafka_stats
from reliable_kafka.errors import (
    ReliableKafkaError,
    TransactionalIdAuthorizationFailed,
    TransactionFailed,
    TransactionFenced,
)
from reliable_kafka.transactions.calls import Deadlines, Failure, call


class TransactionalClient:
    """The producer handle of one transactional.id, the fatal error librdkafka reported for it, and the
    errors its failures stop the instance with.

    `producer` is None until start() went through, after a failed replace() and after release().
    What a failure means for the transaction is the checkpoint's business: failures come back as values.
    """

    def __init__(self, producer_config: dict[str, Any], *, transactional_id: str, deadlines: Deadlines,
                 make: Callable[[dict[str, Any]], Producer] = Producer) -> None:
        """`make` builds the producer from `producer_config` (a stand-in, in tests)."""
        self._config = producer_config
        self._make = make
        # librdkafka tells the reason of a fatal state only to error_cb; produce() then says just _FATAL.
        self._fatal = kafka_errors.FatalError(producer_config.get("error_cb"))
        self._config["error_cb"] = self._fatal
        if (stats_cb := rdkafka_stats.collector(self._config, "transactional_producer")) is not None:
            self._config["stats_cb"] = stats_cb
        self.transactional_id = transactional_id
        self._deadlines = deadlines
        self.producer: Producer | None = None

    def start(self) -> Failure | None:
        """Make a producer and initialise its transactions; the Failure of init_transactions, if any."""
        self._fatal.error = None
        producer = self._make(self._config)
        done = call("init_transactions", lambda: producer.init_transactions(self._deadlines.timeout()),
                    self._deadlines, self.transactional_id)
        if isinstance(done, Failure):
            return done
        self.producer = producer
        return None

    def replace(self) -> Failure | None:
        """Drop the producer and start a new one: its init_transactions settles whatever the old one left."""
        old, self.producer = self.producer, None
        if old is not None:
            # A producer in a fatal state may refuse to purge; it is dropped either way.
            with contextlib.suppress(KafkaException):
                old.purge(in_queue=True, in_flight=True, blocking=False)
            del old
        return self.start()

    def serve_reports(self) -> None:
        """Serve the producer's delivery reports. A fatal error is not raised here (confluent-kafka 2.16
        raises it from poll() once): the transactional call that follows fails with it, and the checkpoint
        decides what it means, as for any failed transactional call."""
        if self.producer is not None:
            self._fatal.poll(self.producer)

    def stop_error(self, failure: Failure) -> ReliableKafkaError:
        """The error a fatal failure stops the instance with: TransactionFenced when it is a fence.

        A fenced producer answers with just _FATAL: the fatal error its error_cb got names the fence."""
        fatal = self._fatal.seen(self.producer)
        cause = fatal if fatal is not None and kafka_errors.code_of(failure.error) == KafkaError._FATAL else None
        reason = kafka_errors.describe(failure.error) + (f" (the producer's fatal error: "
                                                        f"{kafka_errors.describe(cause)})" if cause else "")
        if kafka_errors.is_fenced(failure.error, fatal):
            return TransactionFenced(
                f"transactional.id {self.transactional_id!r} was fenced during {failure.operation} ({reason}): "
                "another instance with the same transactional.id or group.instance.id took over. This "
                "instance stopped; its uncommitted work is aborted and redone by the new owner.",
                code=kafka_errors.name_of(cause or failure.error),
            )
        if kafka_errors.code_of(cause or failure.error) == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
            return TransactionalIdAuthorizationFailed(self.transactional_id, failure.operation, reason)
        return TransactionFailed(
            f"transactional.id {self.transactional_id!r}: fatal error during {failure.operation} "
            f"({reason}). This instance stopped; its uncommitted work is aborted and redone after a "
            "restart.",
            code=kafka_errors.name_of(cause or failure.error),
        )

    def not_initialised(self, failure: Failure) -> TransactionFailed:
        """The error to stop with when init_transactions did not go through in the time allowed."""
        return TransactionFailed(
            f"transactional.id {self.transactional_id!r}: init_transactions did not succeed within "
            f"{self._deadlines.retry_for_s:.0f}s ({kafka_errors.describe(failure.error)}); is the transaction "
            "coordinator reachable and __transaction_state healthy?",
            code=kafka_errors.name_of(failure.error),
        )

    def release(self) -> None:
        """Let the producer go (after the consumer left the group and no commit is waited for)."""
        self.producer = None
