"""Checkpoint on its own, with stand-in clients: the commit order, the backlog, and what each failed step does.

No Kafka here: the fakes record the calls the checkpoint makes and fail the ones a test asks for. The same
paths against librdkafka's mock cluster are in test_transactions_mock.py, and exactly-once itself on the
real cluster in tests/integration/test_transactions.py.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from reliable_kafka import kafka_errors
from reliable_kafka.errors import ConfigError, DeadLetterFailed, ReliableKafkaError, TransactionFenced
from reliable_kafka.transactions import Checkpoint, CommitInfo, Outcome, TransactionalProcessor
from reliable_kafka.transactions.calls import Deadlines
from reliable_kafka.transactions.records import OUT_INPUT_OFFSET, Batch, Out

pytestmark = pytest.mark.timeout(30)

IN = ("in", 0)


class FakeProducer:
    """Records the transactional calls; `fail[op]` lists the exceptions its next calls raise."""

    def __init__(self, fail: dict[str, list[BaseException]], fatal: Any,
                 hang: dict[str, threading.Event] | None = None) -> None:
        self.calls: list[str] = []
        self._hang = hang or {}  # op -> an event the call waits for: librdkafka not returning
        self.produced: list[tuple[Any, ...]] = []
        self.offsets_sent: list[list[TopicPartition]] = []
        self._fail = fail
        self._fatal = fatal  # the error_cb the checkpoint configured, and the fatal error to report to it

    def _call(self, op: str) -> None:
        self.calls.append(op)
        if op in self._hang:
            self._hang.pop(op).wait(60)
        if self._fail.get(op):
            raise self._fail[op].pop(0)

    def init_transactions(self, timeout: float) -> None:
        self._call("init_transactions")

    def begin_transaction(self) -> None:
        self._call("begin_transaction")

    def produce(self, *args: Any) -> None:
        self._call("produce")
        self.produced.append(args)

    def send_offsets_to_transaction(self, partitions: list[TopicPartition], metadata: Any, timeout: float) -> None:
        self._call("send_offsets_to_transaction")
        self.offsets_sent.append(partitions)

    def commit_transaction(self, timeout: float) -> None:
        self._call("commit_transaction")

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort_transaction")

    def poll(self, timeout: float) -> int:
        callback, error = self._fatal
        if error is not None:
            callback(error)  # librdkafka serves the fatal error to error_cb on poll()
        return 0

    def purge(self, **_: Any) -> None:
        pass


class FakeConsumer:
    def __init__(self, committed: int) -> None:
        self.committed_offset = committed
        self.seeks: list[tuple[str, int, int]] = []

    def consumer_group_metadata(self) -> str:
        return "group-metadata"

    def assignment(self) -> list[TopicPartition]:
        return [TopicPartition(*IN)]

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.committed_offset) for tp in partitions]

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))


class Rig:
    """A started Checkpoint owning partition in[0], with its fakes."""

    def __init__(self, fail: dict[str, list[BaseException]] | None = None, *, fatal: KafkaError | None = None,
                 max_batch: int = 100, hang: dict[str, threading.Event] | None = None) -> None:
        self.fail = fail or {}
        self.hang = hang  # the first producer's calls that never return (until the event is set)
        self.fatal = fatal
        self.producers: list[FakeProducer] = []
        self.commits: list[CommitInfo] = []
        self.refused: list[tuple[Out, KafkaException]] = []
        self.stop_error: ReliableKafkaError | None = None
        self.consumer = FakeConsumer(committed=3)
        self.cp = Checkpoint(
            {}, transactional_id="tx-1", group_id="g", max_batch_messages=max_batch, interval_s=60.0,
            deadlines=Deadlines(operation_timeout_s=0.2, stop_timeout_s=1.0), reset_to=0,
            stopping=threading.Event(), on_refused=self._on_refused, on_commit=self.commits.append,
            client=self._client,
        )
        self.cp.start()
        self.cp.consumer = self.consumer  # type: ignore[assignment]
        self.cp.owned.add(IN)

    def _client(self, config: dict[str, Any]) -> Any:
        producer = FakeProducer(self.fail, (config["error_cb"], self.fatal), self.hang if not self.producers else None)
        self.producers.append(producer)
        return producer

    def _on_refused(self, out: Out, exc: KafkaException) -> ReliableKafkaError | None:
        self.refused.append((out, exc))
        return self.stop_error

    @property
    def producer(self) -> FakeProducer:
        return self.producers[-1]

    def reap(self) -> Outcome:
        return self.cp.reap(wait=True)


def batch(*offsets: int, outputs_each: int = 1) -> Batch:
    b = Batch()
    for offset in offsets:
        for i in range(outputs_each):
            b.outputs.extend(("out", b"v", None, -1, f"in/0/{offset}:{i}", IN, offset, False))
        b.offsets[IN] = offset + 1
        b.messages += 1
    return b


def err(code: int, **flags: bool) -> KafkaException:
    return KafkaException(KafkaError(code, "test", **flags))


def test_a_commit_sends_outputs_then_offsets_then_the_end_marker() -> None:
    rig = Rig()
    assert rig.cp.write(batch(3, 4, outputs_each=2)) is Outcome.DONE
    assert rig.cp.open and rig.cp.messages == 2
    rig.cp.commit()
    assert not rig.cp.open  # the next records go into a new transaction
    assert rig.reap() is Outcome.DONE
    assert rig.producer.calls == ["init_transactions", "begin_transaction", *["produce"] * 4,
                                  "send_offsets_to_transaction", "commit_transaction"]
    assert [(tp.topic, tp.partition, tp.offset) for tp in rig.producer.offsets_sent[0]] == [("in", 0, 5)]
    assert rig.commits == [CommitInfo({IN: 5}, messages=2, outputs=4, dead_lettered=0)]
    stats = rig.cp.counters.stats()
    assert (stats.transactions_committed, stats.messages_committed, stats.outputs_committed) == (1, 2, 4)
    # The output's rk-id, held as a str in the tuple, goes out as its header list.
    assert rig.producer.produced[0][7] == [("rk-id", "in/0/3:0")]


def test_records_processed_while_a_commit_runs_wait_in_the_backlog_and_go_into_the_next_transaction() -> None:
    rig = Rig(max_batch=2)
    assert rig.cp.add(batch(3, 4)) is Outcome.DONE  # full: handed to the committer
    assert rig.cp.committing is not None
    assert rig.cp.add(batch(5)) is Outcome.DONE or rig.cp.committing is None
    while rig.cp.committing is not None:  # the committer thread ends the first transaction
        rig.cp.reap(wait=True)
    assert rig.commits[0].offsets == {IN: 5}
    assert rig.cp.open and rig.cp.messages == 1 and not rig.cp.backlog.messages
    rig.cp.commit()
    assert rig.reap() is Outcome.DONE
    assert [c.offsets for c in rig.commits] == [{IN: 5}, {IN: 6}]


def test_an_abortable_commit_failure_aborts_and_rewinds_to_the_committed_offsets() -> None:
    rig = Rig({"send_offsets_to_transaction": [err(KafkaError.ILLEGAL_GENERATION, txn_requires_abort=True)]})
    rig.cp.positions[IN] = 5
    rig.cp.write(batch(3, 4))
    rig.cp.commit()
    assert rig.reap() is Outcome.REWOUND
    assert rig.commits == [] and "commit_transaction" not in rig.producer.calls
    assert rig.producer.calls[-1] == "abort_transaction"
    assert rig.consumer.seeks == [("in", 0, 3)] and rig.cp.positions == {IN: 3}
    stats = rig.cp.counters.stats()
    assert (stats.transactions_aborted, stats.rewinds, stats.producer_recreations) == (1, 1, 0)


def test_a_commit_with_an_unknown_outcome_recreates_the_producer_then_rewinds() -> None:
    rig = Rig({"commit_transaction": [err(KafkaError._TIMED_OUT, retriable=True)] * 50})
    rig.cp.write(batch(3))
    rig.cp.commit()
    assert rig.reap() is Outcome.REWOUND
    assert len(rig.producers) == 2 and rig.producers[1].calls == ["init_transactions"]
    assert rig.cp.counters.stats().producer_recreations == 1 and rig.consumer.seeks == [("in", 0, 3)]


def test_a_commit_call_that_never_returns_is_given_up_and_the_next_producer_commits(monkeypatch) -> None:
    """librdkafka #5456/#5511: send_offsets_to_transaction() may never return once the group coordinator went
    away. The commit is given up once the call is HUNG_GRACE_S past its timeout: a new producer (fencing the
    old one) and a rewind to the committed offsets; the next transaction commits on it."""
    monkeypatch.setattr("reliable_kafka.transactions.calls.HUNG_GRACE_S", 0.3)
    monkeypatch.setattr("reliable_kafka.transactions.checkpoint._HUNG_CHECK_S", 0.05)
    release = threading.Event()
    rig = Rig(hang={"send_offsets_to_transaction": release})
    try:
        rig.cp.write(batch(3, 4))
        rig.cp.commit()
        started = time.monotonic()
        assert rig.reap() is Outcome.REWOUND
        assert time.monotonic() - started < 5  # 0.2 s timeout + 0.3 s grace, not the 60 s of the hang
        assert len(rig.producers) == 2 and rig.producers[1].calls == ["init_transactions"]
        assert rig.consumer.seeks == [("in", 0, 3)] and rig.commits == []
        assert rig.cp.counters.stats().producer_recreations == 1

        rig.cp.write(batch(3, 4))  # redone from the committed offset, on the new producer
        rig.cp.commit()
        release.set()  # the old call returns late: it must not pass for the new commit
        assert rig.reap() is Outcome.DONE
        assert [c.offsets for c in rig.commits] == [{IN: 5}]
        assert rig.producers[1].calls[-2:] == ["send_offsets_to_transaction", "commit_transaction"]
    finally:
        release.set()


def test_a_slow_commit_call_within_its_grace_is_waited_for(monkeypatch) -> None:
    monkeypatch.setattr("reliable_kafka.transactions.calls.HUNG_GRACE_S", 5.0)
    monkeypatch.setattr("reliable_kafka.transactions.checkpoint._HUNG_CHECK_S", 0.05)
    release = threading.Event()
    rig = Rig(hang={"commit_transaction": release})
    threading.Timer(1.0, release.set).start()  # returns after 1 s: past its 0.2 s timeout, inside the grace
    rig.cp.write(batch(3))
    rig.cp.commit()
    assert rig.reap() is Outcome.DONE
    assert len(rig.producers) == 1 and [c.offsets for c in rig.commits] == [{IN: 4}]


def test_a_refused_output_aborts_and_is_reported_to_the_failure_stage() -> None:
    rig = Rig({"produce": [KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))]})
    assert rig.cp.write(batch(3, 4)) is Outcome.REWOUND
    assert [out[OUT_INPUT_OFFSET] for out, _ in rig.refused] == [3]
    assert rig.producer.calls[-1] == "abort_transaction" and not rig.cp.open
    assert rig.cp.counters.stats().transactions_aborted == 1


def test_a_refused_dead_letter_copy_stops_the_instance_after_the_abort() -> None:
    rig = Rig({"produce": [KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))]})
    rig.stop_error = DeadLetterFailed("in[0]@3 could not be written to dead-letter topic 'in.dlq'")
    with pytest.raises(DeadLetterFailed):
        rig.cp.write(batch(3))
    assert rig.producer.calls[-1] == "abort_transaction" and rig.cp.broken is rig.stop_error


def test_fenced_at_commit_stops_with_transaction_fenced_and_commits_nothing() -> None:
    rig = Rig({"commit_transaction": [err(KafkaError.PRODUCER_FENCED, fatal=True)]})
    rig.cp.write(batch(3))
    rig.cp.commit()
    with pytest.raises(TransactionFenced, match="tx-1"):
        rig.reap()
    assert rig.commits == [] and isinstance(rig.cp.broken, TransactionFenced)


def test_a_fatal_refusal_of_a_fenced_producer_stops_with_transaction_fenced() -> None:
    """produce() on a fenced producer says only _FATAL; the abort that follows names the fence."""
    fence = KafkaError(KafkaError.PRODUCER_FENCED, "fenced by a newer instance", fatal=True)
    rig = Rig({"produce": [err(KafkaError._FATAL)], "abort_transaction": [KafkaException(fence)]}, fatal=fence)
    with pytest.raises(TransactionFenced, match="PRODUCER_FENCED") as raised:
        rig.cp.write(batch(3))
    assert raised.value.code == "PRODUCER_FENCED"


def test_a_stop_out_of_time_gives_the_open_transaction_up() -> None:
    rig = Rig()
    rig.cp.write(batch(3))
    rig.cp.deadlines.stop_by = time.monotonic() - 1  # the stop's time is up
    rig.cp.settle("stop requested")
    assert rig.commits == [] and not rig.cp.open
    assert rig.producer.calls[-1] == "abort_transaction" and rig.cp.counters.stats().transactions_aborted == 1


# ---- the classifier's fatal row --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "fatal", "fenced"),
    [
        (KafkaError(KafkaError.PRODUCER_FENCED), None, True),
        (KafkaError(KafkaError._FENCED, fatal=True), None, True),
        (KafkaError(KafkaError._FATAL), None, False),
        # A fenced producer's produce(): "Unable to produce message: Local: Fatal error"; error_cb had the fence.
        (KafkaError(KafkaError._FATAL), KafkaError(KafkaError.PRODUCER_FENCED, fatal=True), True),
        (KafkaError(KafkaError._FATAL), KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, fatal=True),
         False),
        (KafkaError(KafkaError.NOT_COORDINATOR), KafkaError(KafkaError.PRODUCER_FENCED, fatal=True), False),
    ],
)
def test_is_fenced(error: KafkaError, fatal: KafkaError | None, fenced: bool) -> None:
    assert kafka_errors.is_fenced(KafkaException(error), fatal) is fenced


def test_fatal_error_keeps_the_first_fatal_error_and_forwards_all() -> None:
    heard: list[KafkaError] = []
    watch = kafka_errors.FatalError(heard.append)
    watch(KafkaError(KafkaError._TRANSPORT))
    watch(KafkaError(KafkaError.PRODUCER_FENCED, fatal=True))
    watch(KafkaError(KafkaError._FATAL, fatal=True))
    assert watch.seen() is not None and watch.seen().code() == KafkaError.PRODUCER_FENCED  # type: ignore[union-attr]
    assert len(heard) == 3


# ---- group.id, as for ReliableConsumer -------------------------------------------------------------


def _processor(config: dict[str, Any], **kwargs: Any) -> TransactionalProcessor:
    return TransactionalProcessor({"bootstrap.servers": "b:9092", **config}, input_topics=["t"],
                                  transform=lambda m: [], transactional_id="tx", **kwargs)


def test_the_group_is_group_id_in_the_config() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _processor({"group.id": "g"})
    with pytest.raises(ConfigError, match="group.id"):
        _processor({})


def test_group_id_argument_still_works_with_a_warning_showing_the_new_call() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        _processor({}, group_id="g")
    message = str(caught[0].message)
    assert "group_id='g'" in message and "'group.id': 'g'" in message
    assert caught[0].filename == __file__  # points at the caller
    with pytest.warns(DeprecationWarning):
        _processor({"group.id": "g"}, group_id="g")  # the same group twice: no conflict


def test_group_id_and_a_different_group_id_in_the_config_are_refused() -> None:
    with pytest.raises(ConfigError, match="group.id"):
        _processor({"group.id": "a"}, group_id="b")
