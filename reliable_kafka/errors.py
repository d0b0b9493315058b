"""The one exception hierarchy of reliable_kafka.

Every error says what happened and what the user can do about it; nothing here is raised for a
message that was silently dropped, because nothing is ever silently dropped.
"""

from __future__ import annotations


class ReliableKafkaError(Exception):
    """Base class of every error raised by reliable_kafka."""


class ConfigError(ReliableKafkaError, ValueError):
    """A setting would break a delivery guarantee, or is not valid. The message names the key."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


class TopicConfigError(ReliableKafkaError):
    """A topic's replication settings cannot keep the guarantee (preflight refused it)."""

    def __init__(self, topic: str, problems: list[str]) -> None:
        self.topic = topic
        self.problems = problems
        super().__init__(
            f"topic {topic!r} cannot keep acks=all durable: "
            + "; ".join(problems)
            + " (fix the topic, or pass preflight='warn' to proceed anyway)"
        )


class ClusterUnreachable(ReliableKafkaError):
    """No broker answered within the timeout."""


class OutboxError(ReliableKafkaError):
    """The outbox file cannot be used; nothing was written half-way."""


class OutboxCorrupt(OutboxError):
    """The outbox file failed its integrity check; it is left untouched for inspection."""


class OutboxLocked(OutboxError):
    """Another process owns this outbox file."""


class OutboxFull(OutboxError):
    """The outbox reached its bound and stayed full for the whole send timeout; the message was not accepted."""


class SerializationError(ReliableKafkaError, TypeError):
    """A key or value is not bytes and no serializer was given to turn it into bytes."""


class DeliveryFailed(ReliableKafkaError):
    """Kafka refused a message for good; it is kept in the outbox as failed, with the broker's reason."""

    def __init__(self, message_id: str, reason: str) -> None:
        self.message_id = message_id
        self.reason = reason
        super().__init__(f"message {message_id} was refused by Kafka: {reason}")


class ProducerClosed(ReliableKafkaError):
    """send() was called after close()."""


class CommitFailed(ReliableKafkaError):
    """Offsets could not be committed after all retries; nothing past the last committed offset is lost."""


class DeadLetterFailed(ReliableKafkaError):
    """A poison record could not be written to its dead-letter topic; its offset is not committed."""


class DedupStoreUnavailable(ReliableKafkaError):
    """The dedup store cannot be reached; the consumer holds progress (fail-closed) until it is back."""


class TransactionFenced(ReliableKafkaError):
    """Another instance with the same transactional.id took over; this instance stopped."""


class ClusterError(ReliableKafkaError):
    """The local test cluster could not be started, or a node could not be controlled."""


class WriteRefused(ReliableKafkaError):
    """A Spark exactly-once write was refused because its input changed under the same write id."""


class RetriesExhausted(ReliableKafkaError):
    """A retried operation failed on its last allowed attempt, or with an error not worth retrying.

    For a handler this means the record is poison: the consumer parks it on the dead-letter topic.
    `last_error` is the handler's own exception; `attempts` counts the calls that were made.
    """

    def __init__(self, last_error: BaseException, attempts: int) -> None:
        self.last_error = last_error
        self.attempts = attempts
        super().__init__(
            # repr, not str: a handler's exception with a broken __str__ must still become poison.
            f"gave up after {attempts} attempt(s); last error {last_error!r}"
        )


class RetryInterrupted(ReliableKafkaError):
    """A stop was requested while waiting to retry; the work is unfinished, not poison.

    Do not commit the record's offset and do not dead-letter it: it is delivered again to whoever
    owns the partition next. `last_error` is the failure that was about to be retried.
    """

    def __init__(self, last_error: BaseException, attempts: int) -> None:
        self.last_error = last_error
        self.attempts = attempts
        super().__init__(
            f"stopped while waiting to retry after {attempts} attempt(s); the work is unfinished "
            f"(last error {last_error!r})"
        )


class TransactionFailed(ReliableKafkaError):
    """The transactional producer hit a fatal error other than fencing, or could not recover in time.

    This instance stopped; its open transaction is aborted by the coordinator, and the records it
    had not committed are processed again by whoever takes its partitions (or by its restart).
    The message carries the broker's or librdkafka's reason (e.g. an authorisation failure).
    """


class PartitionWriteFailed(ReliableKafkaError):
    """A Spark write task could not deliver (at_least_once) or commit (exactly_once) all of its rows.

    The task fails so that Spark retries it: an at_least_once retry writes the partition again with the
    same rk-ids (dedup drops the copies); an exactly_once retry resumes after its last committed chunk.
    If every retry fails, fix the cause named in the message and run the job again with the same write id.
    """


class ReadIncomplete(ReliableKafkaError):
    """A Spark read task could not read its whole offset range, so it returned nothing at all.

    Either the range's end was not reached in time (leader unavailable, or a transaction stayed open
    below the end offset), or its start was already deleted by retention. Retry when the cluster is
    healthy, or choose offsets that still exist.
    """


class MissingExtra(ReliableKafkaError, ModuleNotFoundError):
    """A part was used without the optional extra that installs its dependencies; the message names it.

    A ModuleNotFoundError too, so code that probes for an optional part with `except ImportError`
    keeps working. `extra` is the extra's name; `name` is the missing module, as for any import error.
    """

    def __init__(self, extra: str, what: str, missing: str) -> None:
        self.extra = extra
        super().__init__(
            f"{what} needs the {extra} extra (module {missing!r} is not installed): "
            f"pip install 'reliable-kafka[{extra}]'",
            name=missing,
        )
