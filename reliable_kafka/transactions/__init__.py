"""Exactly-once consume-transform-produce: TransactionalProcessor and the parts it composes.

Guarantee: see processor.py; every name importable from `reliable_kafka.transactions` before it became
a package still is.
"""

from reliable_kafka.transactions.checkpoint import Checkpoint, CommitInfo, Outcome, ProcessorStats
from reliable_kafka.transactions.processor import DEFAULT_RETRY_POLICY, TransactionalProcessor
from reliable_kafka.transactions.records import MapValues, OutputRecord, Transform
from reliable_kafka.transactions.steps import TxnStep, next_step

__all__ = [
    "DEFAULT_RETRY_POLICY",
    "Checkpoint",
    "CommitInfo",
    "MapValues",
    "Outcome",
    "OutputRecord",
    "ProcessorStats",
    "Transform",
    "TransactionalProcessor",
    "TxnStep",
    "next_step",
]
