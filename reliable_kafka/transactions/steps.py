"""What the processor does after a transactional call failed: `next_step`, a pure decision table.

Guarantee: every transactional error is decided here and only here (built on kafka_errors.classify), so
retry / abort / recreate / stop mean the same in the processor and in the Spark writer.
"""

from __future__ import annotations

import enum

from confluent_kafka import KafkaError, KafkaException

from reliable_kafka import kafka_errors
from reliable_kafka.kafka_errors import Disposition


class TxnStep(enum.Enum):
    """What the processor does after a transactional call failed; decided by `next_step` only."""

    RETRY = "retry"  # call again (with backoff) until the retry deadline
    ABORT = "abort"  # abort the transaction, rewind the consumer to its committed offsets, go on
    RECREATE = "recreate"  # outcome unknown: a new producer settles the old transaction; then rewind
    STOP = "stop"  # fenced or fatal: this instance stops with TransactionFenced / TransactionFailed


def next_step(operation: str, error: KafkaError | KafkaException) -> TxnStep:
    """The one place that decides what an error of a transactional operation means.

    `operation` is the producer call that failed ("init_transactions", "begin_transaction",
    "produce", "send_offsets_to_transaction", "commit_transaction", "abort_transaction") or
    "consume". Built on `kafka_errors.classify`, so librdkafka's own flags come first: fatal() stops,
    txn_requires_abort() aborts.
    """
    if operation == "produce":
        # produce() refused a record: the transaction is incomplete. A fatal producer state shows up
        # here only as _FATAL; the abort that follows reports its real reason (e.g. fenced).
        return TxnStep.ABORT
    disposition = kafka_errors.classify(error)
    if kafka_errors.epoch_bumped(error):
        # The epoch moved on without a newer instance saying so (a takeover answers PRODUCER_FENCED):
        # a new producer takes the current epoch, settles the old transaction and the instance goes on,
        # as Kafka Streams does. The processor stops instead if its consumer no longer owns partitions
        # (a zombie), and the failures-in-a-row limit bounds a fence that keeps coming back.
        return TxnStep.RECREATE
    if operation == "abort_transaction" and disposition is Disposition.FATAL and not kafka_errors.is_fenced(error):
        # Seen under load: an abort right after an output was refused answered INVALID_TXN_STATE,
        # fatal to this producer only. Nothing newer owns the transactional.id, so a new producer's
        # init_transactions settles the old transaction and the instance goes on (bounded by the
        # failures-in-a-row limit, should it recur).
        return TxnStep.RECREATE
    if disposition is Disposition.FATAL:
        return TxnStep.STOP
    if operation == "abort_transaction":
        # An abort that cannot complete is settled by a new producer: its init_transactions aborts
        # whatever the old epoch left open.
        return TxnStep.RETRY if _retriable(error, disposition) else TxnStep.RECREATE
    if disposition is Disposition.ABORTABLE:
        return TxnStep.ABORT
    if operation == "commit_transaction" and kafka_errors.outcome_unknown(error):
        # EndTxn may or may not have landed. Jepsen showed that a client which moves on from here can
        # see a late EndTxn, or late records of the old transaction, slip into its next transaction
        # (KIP-890 closes this on the broker; librdkafka does not implement it). A new producer bumps
        # the epoch: the coordinator completes or aborts the old transaction and fences every request
        # still in flight from it; the committed offsets then say which of the two happened.
        return TxnStep.RECREATE
    if _retriable(error, disposition):
        return TxnStep.RETRY
    # A permanent error librdkafka did not flag as abortable: the transaction cannot be trusted.
    return TxnStep.ABORT


def _retriable(error: KafkaError | KafkaException, disposition: Disposition) -> bool:
    inner = error.args[0] if isinstance(error, KafkaException) and error.args else error
    flagged = isinstance(inner, KafkaError) and inner.retriable()
    return flagged or disposition in (Disposition.RETRIABLE, Disposition.COORDINATOR)
