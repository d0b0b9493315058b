"""The one place that classifies Kafka errors.

Producer delivery reports, consumer commits and transactions all ask `classify()` what an error
means, so "retry", "give up on this message", "rebuild the client" and "abort the transaction"
are decided the same way everywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException


class Disposition(enum.Enum):
    RETRIABLE = "retriable"  # try the same thing again (maybe after backoff)
    PERMANENT = "permanent"  # this message/request will never succeed: keep it as failed, say why
    FATAL = "fatal"  # the client instance is unusable: recreate it (producer) or stop (fenced txn)
    ABORTABLE = "abortable"  # the current transaction must be aborted, then work can go on
    REBALANCE = "rebalance"  # group membership moved on: drop staged offsets of revoked partitions
    COORDINATOR = "coordinator"  # the group/txn coordinator moved or is loading: retry
    # The principal lacks a permission (an ACL). Not the message's fault and not for good: an operator
    # grants it and the same request succeeds. Keep the work waiting (backing off), say what is missing.
    AUTHORIZATION = "authorization"
    # The client is being closed (librdkafka destroys its broker handles): nothing it sends can succeed any
    # more, so the call is not retried; what it carried stays pending (uncommitted, or in the spool).
    CLOSED = "closed"


# Refused for good by the broker or by librdkafka before sending.
_PERMANENT_CODES = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_RECORD,
    KafkaError.INVALID_MSG,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_REQUIRED_ACKS,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError.INVALID_TIMESTAMP,
    KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
    KafkaError._INVALID_ARG,
    KafkaError.POLICY_VIOLATION,
}

# The idempotent/transactional producer state is gone: only a fresh producer can go on.
_FATAL_CODES = {
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError._FENCED,
    KafkaError.PRODUCER_FENCED,
    KafkaError.INVALID_PRODUCER_ID_MAPPING,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    KafkaError._FATAL,
}

# Refused for want of an ACL. TRANSACTIONAL_ID_AUTHORIZATION_FAILED stays in _FATAL_CODES: librdkafka
# makes it fatal to the transactional producer, which must stop and be restarted once granted.
_AUTHORIZATION_CODES = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.GROUP_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.DELEGATION_TOKEN_AUTHORIZATION_FAILED,
}

_REBALANCE_CODES = {
    KafkaError.REBALANCE_IN_PROGRESS,
    KafkaError.ILLEGAL_GENERATION,
    KafkaError.UNKNOWN_MEMBER_ID,
    KafkaError.FENCED_INSTANCE_ID,
    KafkaError.STALE_MEMBER_EPOCH,
    KafkaError._ASSIGNMENT_LOST,
}

_COORDINATOR_CODES = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError._WAIT_COORD,
    KafkaError.CONCURRENT_TRANSACTIONS,
}


# A commit served inside Consumer.close() got _DESTROY, "retried" for its whole 30 s deadline while
# the close waited on it.
_CLOSED_CODES = {KafkaError._DESTROY}


def _unwrap(error: KafkaError | KafkaException | int) -> KafkaError | int | None:
    if isinstance(error, KafkaException):
        inner = error.args[0] if error.args else None
        return inner if isinstance(inner, (KafkaError, int)) else None
    return error


def classify(error: KafkaError | KafkaException | int) -> Disposition:
    """What an error means for the operation that got it."""
    err = _unwrap(error)
    if err is None:
        return Disposition.RETRIABLE  # a KafkaException without a code: nothing says it is final
    if isinstance(err, KafkaError):
        if err.fatal():
            return Disposition.FATAL
        if err.txn_requires_abort():
            return Disposition.ABORTABLE
        code = int(err.code())
    else:
        code = int(err)
    if code in _FATAL_CODES:
        return Disposition.FATAL
    if code in _REBALANCE_CODES:
        return Disposition.REBALANCE
    if code in _COORDINATOR_CODES:
        return Disposition.COORDINATOR
    if code in _PERMANENT_CODES:
        return Disposition.PERMANENT
    if code in _AUTHORIZATION_CODES:
        return Disposition.AUTHORIZATION
    if code in _CLOSED_CODES:
        return Disposition.CLOSED
    # Everything else (timeouts, leader moves, transport, _MSG_TIMED_OUT with an unknown outcome,
    # NOT_ENOUGH_REPLICAS) is worth another try: a spooled message is re-sent, never dropped.
    return Disposition.RETRIABLE


# Another instance with the same transactional.id (or group.instance.id) took over: this one must stop,
# never re-initialise, or it would fence the newer instance in turn.
_FENCED_CODES = {
    KafkaError._FENCED,
    KafkaError.PRODUCER_FENCED,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.FENCED_INSTANCE_ID,
}

# The request may or may not have taken effect on the broker: the client gave up waiting, not the broker.
_OUTCOME_UNKNOWN_CODES = {
    KafkaError._TIMED_OUT,
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError._TRANSPORT,
}


def is_fenced(error: KafkaError | KafkaException | int, fatal: KafkaError | None = None) -> bool:
    """True when a newer instance fenced this one (same transactional.id or group.instance.id).

    `fatal` is the client's fatal error as its error_cb reported it (see FatalError). A call on a producer
    already in its fatal state fails with _FATAL ("Local: Fatal error"), which hides the reason: the
    fatal error says whether it was a fence.
    """
    code = code_of(error)
    if code == KafkaError._FATAL and fatal is not None:
        code = code_of(fatal)
    return code in _FENCED_CODES


class FatalError:
    """An error_cb that keeps the client's fatal error, the reason behind a later _FATAL.

    librdkafka hands error_cb the underlying error of a fatal state (its ERR__FATAL event translated, with
    fatal() true), while produce() on that client only says _FATAL. Other errors go to `forward`, the
    error_cb the caller configured, if any. confluent-kafka 2.16 no longer calls error_cb for a fatal
    error: poll() raises it once, as a KafkaException, and `seen()` keeps it from there.
    """

    def __init__(self, forward: Callable[[KafkaError], None] | None = None) -> None:
        self.error: KafkaError | None = None
        self._forward = forward

    def __call__(self, error: KafkaError) -> None:
        if error.fatal() and self.error is None:
            self.error = error
        if self._forward is not None:
            self._forward(error)

    def seen(self, client: Any = None) -> KafkaError | None:
        """The fatal error, once `client` (the producer it watches) served its pending callbacks."""
        if self.error is None and client is not None:
            self.poll(client)
        return self.error

    def poll(self, client: Any) -> None:
        """Serve `client`'s pending callbacks (poll(0)); a fatal error that poll() raises is kept, not raised
        (the next call that depends on the client's state, a transactional one, reports it)."""
        try:
            client.poll(0)
        except KafkaException as exc:
            # The fatal event, raised instead of handed to error_cb; poll() raises it only once.
            err = _unwrap(exc)
            if isinstance(err, KafkaError) and err.fatal():
                self.error = err
        except RuntimeError:  # the client is closed
            pass


# The broker holds a newer epoch for this producer id than the request carried (INVALID_PRODUCER_EPOCH).
# Since KIP-588 a takeover by a newer instance is answered PRODUCER_FENCED by the transaction
# coordinator; the old-epoch answer also comes when nobody else took over: the coordinator bumped the
# epoch itself (a transaction it timed out) or a coordinator that just moved holds a newer producer state
# (seen on TxnOffsetCommit right after a broker was SIGKILLed). librdkafka reports both as _FENCED and
# keeps only the broker's text, so that text is what tells them apart.
_OLD_EPOCH_TEXT = KafkaError(KafkaError.INVALID_PRODUCER_EPOCH).str()


def epoch_bumped(error: KafkaError | KafkaException | int) -> bool:
    """True for an old-epoch refusal that does not say a newer instance took over (see _OLD_EPOCH_TEXT)."""
    err = _unwrap(error)
    code = code_of(error)
    if code == KafkaError.INVALID_PRODUCER_EPOCH:
        return True
    return code == KafkaError._FENCED and isinstance(err, KafkaError) and _OLD_EPOCH_TEXT in err.str()


def old_epoch_on_produce(error: KafkaError | KafkaException | int) -> bool:
    """True for an old-epoch refusal of a ProduceRequest, i.e. from a partition leader.

    A partition leader learns a newer epoch of a producer id only from the transaction markers the
    transaction coordinator writes when it bumps the epoch: for a newer instance's init_transactions (a
    takeover), or to abort a transaction that outlived transaction.timeout.ms. librdkafka names the request
    at the start of the fatal error's text ("ProduceRequest for <topic> [<partition>] ... failed: ...").
    """
    err = _unwrap(error)
    return epoch_bumped(error) and isinstance(err, KafkaError) and err.str().startswith("ProduceRequest")


def not_authorized(error: KafkaError | KafkaException | int) -> bool:
    """True when the principal lacks a permission, whether librdkafka made the error fatal or not (an
    idempotent producer refused a producer id: CLUSTER_AUTHORIZATION_FAILED, fatal)."""
    return code_of(error) in _AUTHORIZATION_CODES


def outcome_unknown(error: KafkaError | KafkaException | int) -> bool:
    """True when the failed request may still have been applied (timeout, connection lost mid-request)."""
    return code_of(error) in _OUTCOME_UNKNOWN_CODES


def code_of(error: KafkaError | KafkaException | int) -> int | None:
    """The numeric Kafka error code, or None for an exception that carries none."""
    err = _unwrap(error)
    if isinstance(err, KafkaError):
        return int(err.code())
    return err


def name_of(error: KafkaError | KafkaException | int) -> str | None:
    """The Kafka or librdkafka error name (e.g. "PRODUCER_FENCED"), the `code` our errors carry; or None."""
    err = _unwrap(error)
    if isinstance(err, KafkaError):
        return str(err.name())
    if isinstance(err, int):
        return str(KafkaError(err).name())
    return None


def describe(error: KafkaError | KafkaException | int) -> str:
    """A readable reason, as the broker or librdkafka gave it."""
    err = _unwrap(error)
    if isinstance(err, KafkaError):
        return f"{err.name()}: {err.str()}"
    if isinstance(err, int):
        return str(KafkaError(err).name())
    return str(error)
