"""The one exception hierarchy of reliable_kafka.

Every error says what happened and what the user can do about it; nothing here is raised for a
message that was silently dropped, because nothing is ever silently dropped. The middle classes group
errors by what the caller does next, so one `except` clause can handle a whole branch::

    ReliableKafkaError                 (code, topic, partition: set where known, else None)
    ├── InputRefused                   refused before anything was written: fix the input, call again
    │   ├── ConfigError                (also ValueError) a setting is unsafe or invalid
    │   ├── TopicConfigError           the preflight refused a topic's replication settings
    │   │   └── TopicMissing           the topic does not exist (create it: reliable_kafka.ensure_topic)
    │   ├── SerializationError         (also TypeError) a key or value is not bytes, or its serializer failed
    │   ├── DeserializationError       (also ValueError) a record's key or value could not be decoded (poison)
    │   ├── WrongEventLoop             (also RuntimeError) an asyncio client used from another event loop
    │   └── WriteRefused               a Spark exactly-once write's input changed under its write id
    ├── Unavailable                    something needed did not answer in time: nothing lost, retry later
    │   ├── ClusterUnreachable         no broker answered
    │   ├── CommitFailed               offsets not committed; the records are delivered again
    │   ├── DedupStoreUnavailable      the dedup store cannot be reached (fail-closed)
    │   ├── ReadIncomplete             a Spark read task could not read its whole range
    │   └── OutboxFull                 (also OutboxError) the outbox stayed full for the send timeout
    ├── RefusedByKafka                 Kafka refused the work for good, or stopped this instance
    │   ├── AuthenticationFailed       the brokers refused the credentials (SASL login)
    │   ├── AuthorizationFailed        the principal lacks an ACL (the message names it and the fix)
    │   │   ├── TopicAuthorizationFailed    an operation on a topic is not allowed
    │   │   ├── GroupAuthorizationFailed    reading as a consumer group is not allowed
    │   │   ├── ClusterAuthorizationFailed  an operation on the cluster is not allowed
    │   │   └── TransactionalIdAuthorizationFailed  (also TransactionFailed) using the transactional.id
    │   ├── DeliveryFailed             a message was refused; it is kept in the outbox as failed
    │   ├── TransactionFenced          another instance took over the transactional.id
    │   └── TransactionFailed          a fatal transactional error, or no recovery in time
    ├── OutboxError                    the outbox file cannot be used
    │   ├── OutboxCorrupt
    │   ├── OutboxLocked
    │   └── OutboxFull
    ├── DeadLetterFailed               a poison record could not reach its dead-letter topic
    ├── PartitionFenced                another consumer took the partition's dedup lease over (zombie)
    ├── PartitionWriteFailed           a Spark write task failed; Spark retries it
    ├── RetriesExhausted               a handler failed on its last attempt (poison)
    ├── RetryInterrupted               a stop came while waiting to retry (unfinished, not poison)
    ├── ClientClosed                   a call that needs a running client, after close()
    │   └── ProducerClosed             send() after close()
    ├── ClusterError                   the local test cluster could not be started or controlled
    └── MissingExtra                   (also ModuleNotFoundError) an optional extra is not installed

Classes only ever gain bases, never lose them: an `except` clause that caught an error still does.
"""

from __future__ import annotations

from typing import Any


class ReliableKafkaError(Exception):
    """Base class of every error raised by reliable_kafka.

    `code` is the Kafka or librdkafka error name when Kafka gave one (e.g. "PRODUCER_FENCED"),
    `topic` and `partition` the Kafka topic and partition the error is about; each is None when the
    error has none.
    """

    code: str | None = None
    topic: str | None = None
    partition: int | None = None

    def __init__(
        self, *args: object, code: str | None = None, topic: str | None = None, partition: int | None = None
    ) -> None:
        super().__init__(*args)
        self.code = code
        self.topic = topic
        self.partition = partition

    def __reduce__(self) -> tuple[Any, ...]:
        # Spark sends a task's exception to the driver pickled, and pickle rebuilds an exception by calling
        # its class with `args` (the message): subclasses whose constructor takes other arguments
        # (ConfigError(key, reason), TopicAuthorizationFailed(topic, operation), ...) would fail to
        # unpickle. Rebuild from the message and the attributes instead.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type[ReliableKafkaError], args: tuple[Any, ...], state: dict[str, Any]) -> ReliableKafkaError:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class InputRefused(ReliableKafkaError):
    """reliable_kafka refused a setting, a topic or a value before writing anything: fix it and call again."""


class Unavailable(ReliableKafkaError):
    """Something the call needs (the brokers, a coordinator, the dedup store, room in the outbox) did not
    answer or free up in time. Nothing was lost or half-done: the same call can succeed once it is back."""


class RefusedByKafka(ReliableKafkaError):
    """Kafka refused the work for good, or stopped this instance: the same call will not succeed again.
    The message carries Kafka's reason (and `code` its error name, where Kafka gave one)."""


class AuthenticationFailed(RefusedByKafka):
    """The brokers refused this client's login (SASL): wrong credentials, or a mechanism they do not enable.
    Never reported as an unreachable cluster. The message names the user and mechanism, never a secret."""

    def __init__(self, username: str | None, mechanism: str | None, reason: str) -> None:
        self.username = username
        self.mechanism = mechanism
        super().__init__(
            f"the brokers refused to authenticate {username or '(no sasl.username)'!r} with SASL mechanism "
            f"{mechanism or 'GSSAPI (the default)'} ({reason}): check sasl.username and sasl.password, and that "
            "sasl.mechanism is one the listener enables (sasl.enabled.mechanisms on the brokers)",
            code="_AUTHENTICATION",
        )


class AuthorizationFailed(RefusedByKafka):
    """The client's principal is not allowed an operation: an ACL is missing. Never reported as a
    missing topic or an unreachable cluster; the message names the operation and the grant."""


class TopicAuthorizationFailed(AuthorizationFailed):
    """The principal may not perform `operation` on `topic` (Kafka's TOPIC_AUTHORIZATION_FAILED)."""

    def __init__(self, topic: str, operation: str) -> None:
        self.operation = operation
        # A client that writes needs Describe (metadata) and Write: name both whichever was refused.
        grants = ["Describe", operation] if operation in ("Read", "Write") else [operation, "Write"]
        super().__init__(
            f"not authorized to {operation} topic {topic!r} (TOPIC_AUTHORIZATION_FAILED): the topic may well "
            f"exist. Grant the principal this client authenticates as (its sasl.username) "
            f"{' and '.join(grants)} on it, e.g. kafka-acls.sh --bootstrap-server <brokers> --add "
            f"--allow-principal User:<name> {' '.join('--operation ' + g for g in grants)} --topic {topic}",
            code="TOPIC_AUTHORIZATION_FAILED", topic=topic,
        )


class ClusterAuthorizationFailed(AuthorizationFailed):
    """The principal may not perform `operation` on the cluster resource (CLUSTER_AUTHORIZATION_FAILED)."""

    def __init__(self, operation: str) -> None:
        self.operation = operation
        super().__init__(
            f"not authorized to {operation} on the cluster (CLUSTER_AUTHORIZATION_FAILED): grant it, e.g. "
            f"kafka-acls.sh --bootstrap-server <brokers> --add --allow-principal User:<name> "
            f"--operation {operation} --cluster",
            code="CLUSTER_AUTHORIZATION_FAILED",
        )


class GroupAuthorizationFailed(AuthorizationFailed):
    """The principal may not use consumer group `group` (Kafka's GROUP_AUTHORIZATION_FAILED)."""

    def __init__(self, group: str) -> None:
        super().__init__(
            f"not authorized to Read consumer group {group!r} (GROUP_AUTHORIZATION_FAILED): grant the principal "
            f"this client authenticates as Read on the group (and Describe and Read on its topics), e.g. "
            f"kafka-acls.sh --bootstrap-server <brokers> --add --allow-principal User:<name> --operation Read "
            f"--group {group}",
            code="GROUP_AUTHORIZATION_FAILED",
        )
        self.group = group


class ConfigError(InputRefused, ValueError):
    """A setting would break a delivery guarantee, or is not valid. The message names the key."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


class TopicConfigError(InputRefused):
    """A topic's replication settings cannot keep the guarantee (preflight refused it)."""

    def __init__(self, topic: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(
            f"topic {topic!r} cannot keep acks=all durable: "
            + "; ".join(problems)
            + " (fix the topic, or pass preflight='warn' to proceed anyway)",
            topic=topic,
        )


class TopicMissing(TopicConfigError):
    """The topic does not exist (the brokers do not create topics on first use): create it first."""

    def __init__(self, topic: str) -> None:
        self.problems = ["it does not exist"]
        InputRefused.__init__(
            self,
            f"topic {topic!r} does not exist: create it with reliable_kafka.ensure_topic(config, {topic!r}) "
            f"(replication factor 3, min.insync.replicas=2), or kafka-topics.sh --create --topic {topic} "
            "--replication-factor 3 --config min.insync.replicas=2",
            topic=topic,
        )


class ClusterUnreachable(Unavailable):
    """No broker answered within the timeout."""


class OutboxError(ReliableKafkaError):
    """The outbox file cannot be used; nothing was written half-way."""


class OutboxCorrupt(OutboxError):
    """The outbox file failed its integrity check; it is left untouched for inspection."""


class OutboxLocked(OutboxError):
    """Another process owns this outbox file."""


class OutboxFull(OutboxError, Unavailable):
    """The outbox reached its bound and stayed full for the whole send timeout; the message was not accepted."""


class SerializationError(InputRefused, TypeError):
    """A key or value is not bytes and no serializer turned it into bytes, or its serializer raised.

    The serializer's own exception (a Schema Registry serializer's, say) is chained as `__cause__`; the
    message names the topic and whether the key or the value failed. Nothing was accepted.
    """


class DeserializationError(InputRefused, ValueError):
    """A record's key or value could not be decoded by the consumer's deserializer.

    The deserializer's own exception is chained as `__cause__`; `field` is "key" or "value". For the
    handler API the record is poison like a failing handler: retried by the RetryPolicy (a Schema
    Registry that was briefly away decodes it on a later attempt), then written to the dead-letter
    topic with its original bytes. Never skipped silently, never retried forever. From the explicit API
    (poll(), iteration) it is raised with `record`: the Message as consumed, still in flight, so its
    offset is not committed until you ack() it.
    """

    record: Any = None

    def __init__(self, *args: object, field: str | None = None, code: str | None = None,
                 topic: str | None = None, partition: int | None = None) -> None:
        super().__init__(*args, code=code, topic=topic, partition=partition)
        self.field = field


class WrongEventLoop(InputRefused, RuntimeError):
    """An asyncio client was called from an event loop other than the one it started on; nothing was
    written. Create the client in (and use it from) one loop, or one client per loop."""


class DeliveryFailed(RefusedByKafka):
    """Kafka refused a message for good; it is kept in the outbox as failed, with the broker's reason."""

    def __init__(
        self, message_id: str, reason: str, *, topic: str | None = None, partition: int | None = None
    ) -> None:
        self.message_id = message_id
        self.reason = reason
        super().__init__(f"message {message_id} was refused by Kafka: {reason}", topic=topic, partition=partition)


class ClientClosed(ReliableKafkaError):
    """A client was used after close(): create a new one (close() itself may be called again)."""


class ProducerClosed(ClientClosed):
    """send() was called after close()."""


class CommitFailed(Unavailable):
    """Offsets could not be committed after all retries; nothing past the last committed offset is lost."""


class DeadLetterFailed(ReliableKafkaError):
    """A poison record could not be written to its dead-letter topic; its offset is not committed."""


class DedupStoreUnavailable(Unavailable):
    """The dedup store cannot be reached; the consumer holds progress (fail-closed) until it is back."""


class PartitionFenced(ReliableKafkaError):
    """Another consumer took over a partition's dedup lease: this one lost the partition (it was paused past
    its session, say) and must not record its keys or commit its offsets. The consumer stops processing the
    partition until the group assigns it again; the new owner processes its records."""

    def __init__(self, message: str, *, partitions: list[tuple[str, int]] | None = None) -> None:
        super().__init__(message)
        self.partitions = list(partitions or [])
        """The (topic, partition) pairs whose lease is no longer this consumer's."""


class TransactionFenced(RefusedByKafka):
    """Another instance with the same transactional.id took over; this instance stopped."""


class ClusterError(ReliableKafkaError):
    """The local test cluster could not be started, or a node could not be controlled."""


class WriteRefused(InputRefused):
    """A Spark exactly-once write was refused because its input changed under the same write id.

    Also raised by a stale attempt of a stream micro-batch whose markers a later batch released.
    """


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


class TransactionFailed(RefusedByKafka):
    """The transactional producer hit a fatal error other than fencing, or could not recover in time.

    This instance stopped; its open transaction is aborted by the coordinator, and the records it
    had not committed are processed again by whoever takes its partitions (or by its restart).
    The message carries the broker's or librdkafka's reason (e.g. an authorisation failure).
    """


class TransactionalIdAuthorizationFailed(TransactionFailed, AuthorizationFailed):
    """The principal may not use `transactional_id` (TRANSACTIONAL_ID_AUTHORIZATION_FAILED): the
    transactional producer stopped; restart it once granted."""

    def __init__(self, transactional_id: str, operation: str, reason: str, *, prefix: str | None = None) -> None:
        # `prefix`: the ids are made per run (Spark: per write id and partition), so the grant is a prefix.
        resource = (f"--transactional-id {prefix} --resource-pattern-type prefixed" if prefix
                    else f"--transactional-id {transactional_id}")
        super().__init__(
            f"transactional.id {transactional_id!r}: not authorized to use it during {operation} ({reason}). "
            f"This instance stopped; its uncommitted work is redone after a restart. Grant the principal "
            f"Write and Describe on the transactional id (and Write on the output topics, Read on the group), "
            f"e.g. kafka-acls.sh --bootstrap-server <brokers> --add --allow-principal User:<name> "
            f"--operation Write --operation Describe {resource}",
            code="TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
        )
        self.transactional_id = transactional_id


class PartitionWriteFailed(ReliableKafkaError):
    """A Spark write task could not deliver (at_least_once) or commit (exactly_once) all of its rows.

    The task fails so that Spark retries it: an at_least_once retry writes the partition again with the
    same rk-ids (dedup drops the copies); an exactly_once retry resumes after its last committed chunk.
    If every retry fails, fix the cause named in the message and run the job again with the same write id.
    """


class ReadIncomplete(Unavailable):
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
            f"pip install 'reliable-kafka[{extra}]'"
        )
        self.name = missing
