"""TransactionalProcessor's error paths against the librdkafka mock cluster, plus its error table.

The mock injects errors and slow responses on InitProducerId, AddPartitionsToTxn, TxnOffsetCommit and
EndTxn; each test shows the processor doing what next_step() says: retry coordinator errors without
aborting, abort and rewind what is abortable, recreate the producer when a commit's outcome is unknown,
stop when fenced. The mock is not Kafka (it does not store transactional offsets, nor enforce
read_committed): exactly-once itself is proven on the real cluster in tests/integration.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from reliable_kafka import kafka_errors
from reliable_kafka.config import transactional_producer_config
from reliable_kafka.dlq import parse_dead_letter_headers
from reliable_kafka.errors import (
    AuthorizationFailed,
    ConfigError,
    TransactionalIdAuthorizationFailed,
    TransactionFailed,
    TransactionFenced,
)
from reliable_kafka.testing.mock import MockCluster
from reliable_kafka.transactions import (
    MapValues,
    OutputRecord,
    ProcessorStats,
    TransactionalProcessor,
    TxnStep,
    next_step,
)

# waits: its seconds go to librdkafka's timers against a mock or absent broker, not to code that differs
# between Pythons; `./dev pythons` (the unit tier on 3.10 and 3.13) leaves it out to stay in the budget.
pytestmark = [pytest.mark.timeout(90), pytest.mark.waits]

N = 100
TXN_COORDINATOR, GROUP_COORDINATOR, LEADER = 3, 2, 1
COORDINATOR_ERRORS = [KafkaError.NOT_COORDINATOR, KafkaError.CONCURRENT_TRANSACTIONS,
                      KafkaError.COORDINATOR_NOT_AVAILABLE]


@pytest.fixture
def mock() -> Iterator[MockCluster]:
    with MockCluster(brokers=3) as cluster:
        yield cluster
    # A Copy and its clients form a cycle (the processor's producer calls back into the Copy), so only the
    # cyclic collector frees them, and until it ran their librdkafka handles went on reconnecting to the
    # stopped mock for the rest of the worker's life, logging a refused connection a second each.
    gc.collect()


class Copy:
    """A TransactionalProcessor copying one mock topic to another in a thread, with the request counts
    librdkafka's statistics report, and the transaction and partition leaders on brokers of their own
    (so one of them can be slowed down alone)."""

    def __init__(self, mock: MockCluster, timeout_s: float = 2.0,
                 transform: Callable[[Message, str], list[OutputRecord]] | None = None,
                 batch_interval_s: float = 0.1, producer_overrides: dict[str, Any] | None = None,
                 mapped: Callable[[Message], Any] | None = None) -> None:
        self.mock = mock
        suffix = uuid.uuid4().hex[:6]
        self.source, self.output = f"in-{suffix}", f"out-{suffix}"
        self.tid, self.group = f"tx-{suffix}", f"g-{suffix}"
        for topic in (self.source, self.output):
            mock.create_topic(topic, 1)
            mock.set_leader(topic, 0, LEADER)
        mock.set_coordinator("transaction", self.tid, TXN_COORDINATOR)
        mock.set_coordinator("group", self.group, GROUP_COORDINATOR)
        self.committed = 0
        self.error: BaseException | None = None
        self._requests: dict[str, int] = {}
        self._feeder = Producer({"bootstrap.servers": mock.bootstrap_servers})
        self.processor = TransactionalProcessor(
            {"bootstrap.servers": mock.bootstrap_servers, "group.id": self.group},
            input_topics=[self.source],
            transform=MapValues(self.output, mapped) if mapped is not None
            else (lambda msg: [OutputRecord(self.output, msg.value(), msg.key())]) if transform is None
            else (lambda msg: transform(msg, self.output)),
            transactional_id=self.tid,
            operation_timeout_s=timeout_s,
            on_commit=self._on_commit,
            max_batch_interval_s=batch_interval_s,
            producer_overrides={"statistics.interval.ms": 100, "stats_cb": self._on_stats,
                                **(producer_overrides or {})},
        )
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _on_commit(self, info: Any) -> None:
        self.committed += info.messages

    def _on_stats(self, raw: str) -> None:
        counts: dict[str, int] = {}
        for broker in json.loads(raw)["brokers"].values():
            for api, n in broker["req"].items():
                counts[api] = counts.get(api, 0) + n
        self._requests = counts

    def _run(self) -> None:
        try:
            with self.processor:
                self.processor.run()
        except BaseException as exc:  # the test inspects it
            self.error = exc

    def feed(self, n: int = N,
             headers: Callable[[int], list[tuple[str, bytes | None]] | None] = lambda i: None) -> None:
        for i in range(n):
            self._feeder.produce(self.source, f"v-{i}".encode(), headers=headers(i))
        assert self._feeder.flush(10) == 0

    def start(self) -> Copy:
        self._thread.start()
        return self

    def wait(self, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.error is None, f"the processor stopped while waiting for {what}: {self.error!r}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}; stats {self.stats}"
            time.sleep(0.05)

    def wait_committed(self, n: int) -> None:
        self.wait(lambda: self.committed >= n, f"{n} committed input records")

    def requests(self, api: str) -> int:
        return self._requests.get(api, 0)

    @property
    def stats(self) -> ProcessorStats:
        return self.processor.stats()

    def finish(self) -> ProcessorStats:
        self.processor.stop()
        self._thread.join(30)
        assert not self._thread.is_alive(), "run() did not return after stop()"
        return self.stats

    def join(self) -> None:
        """Wait for run() to end by itself (it raised)."""
        self._thread.join(30)
        assert not self._thread.is_alive(), "run() did not stop"


def counts_requests_afterwards(copy: Copy) -> None:
    """One more batch later on: librdkafka's statistics (every 100 ms) then include the faulty requests."""
    time.sleep(0.3)
    done = copy.committed
    copy.feed()
    copy.wait_committed(done + N)


# ---- retriable: coordinator errors are retried, nothing is aborted -------------------------------


@pytest.mark.parametrize("api", ["InitProducerId", "AddPartitionsToTxn", "TxnOffsetCommit", "EndTxn"])
def test_coordinator_errors_are_retried_without_aborting(mock: MockCluster, api: str) -> None:
    copy = Copy(mock)
    copy.feed()
    mock.push_request_errors(api, COORDINATOR_ERRORS)  # NOT_COORDINATOR, CONCURRENT_..., COORDINATOR_NOT_AVAILABLE
    copy.start().wait_committed(N)
    counts_requests_afterwards(copy)
    stats = copy.finish()
    assert copy.error is None
    assert copy.requests(api) >= len(COORDINATOR_ERRORS) + 1, f"the {api} errors were never met"
    assert (stats.transactions_aborted, stats.producer_recreations, stats.rewinds) == (0, 0, 0), stats


# ---- slow responses past the operation timeout ---------------------------------------------------


def test_slow_init_producer_id_is_retried(mock: MockCluster, caplog: pytest.LogCaptureFixture) -> None:
    copy = Copy(mock)
    copy.feed()
    mock.set_rtt(TXN_COORDINATOR, 2_500)  # every answer of the transaction coordinator outlasts the 2 s timeout
    copy.start()
    copy.wait(lambda: any("init_transactions" in r.getMessage() and "retrying" in r.getMessage()
                          for r in caplog.records), "init_transactions to time out and be retried")
    mock.set_rtt(TXN_COORDINATOR, 0)
    copy.wait_committed(N)
    stats = copy.finish()
    assert copy.error is None
    assert (stats.transactions_aborted, stats.producer_recreations) == (0, 0), stats


@pytest.mark.parametrize("api", ["AddPartitionsToTxn", "EndTxn"])
def test_a_commit_past_its_timeout_has_an_unknown_outcome_so_the_producer_is_recreated(
    mock: MockCluster, api: str, caplog: pytest.LogCaptureFixture
) -> None:
    copy = Copy(mock)
    copy.feed()
    copy.start().wait_committed(N)
    # Each answer of the coordinator takes 1.2 s, and the first two are "try again": the request takes
    # well over the 2 s commit timeout, while AddOffsetsToTxn alone (1.2 s) still fits.
    mock.set_rtt(TXN_COORDINATOR, 1_200)
    mock.push_request_errors(api, [KafkaError.CONCURRENT_TRANSACTIONS] * 2)
    copy.feed()
    copy.wait(lambda: copy.stats.producer_recreations >= 1, "the producer to be recreated")
    mock.set_rtt(TXN_COORDINATOR, 0)
    copy.wait_committed(2 * N)
    stats = copy.finish()
    assert copy.error is None
    assert stats.producer_recreations == 1 and stats.rewinds >= 1, stats
    assert any(r.getMessage().startswith("transaction not committed: commit_transaction: _TIMED_OUT")
               for r in caplog.records), "the recreation must come from the commit's timeout"


def test_txn_offset_commit_past_its_timeout_aborts_and_rewinds(
    mock: MockCluster, caplog: pytest.LogCaptureFixture
) -> None:
    copy = Copy(mock)
    copy.feed()
    copy.start().wait_committed(N)
    mock.set_rtt(GROUP_COORDINATOR, 1_200)
    mock.push_request_errors("TxnOffsetCommit", [KafkaError.CONCURRENT_TRANSACTIONS] * 2)
    copy.feed()
    copy.wait(lambda: copy.stats.transactions_aborted >= 1, "the transaction to be aborted")
    mock.set_rtt(GROUP_COORDINATOR, 0)
    copy.wait_committed(2 * N)
    stats = copy.finish()
    assert copy.error is None
    assert stats.rewinds >= 1 and stats.producer_recreations == 0, stats
    assert any(r.getMessage().startswith("transaction not committed: send_offsets_to_transaction")
               and r.getMessage().endswith("-> abort") for r in caplog.records)


# ---- abortable and fatal ---------------------------------------------------------------------------


def test_a_stale_group_generation_aborts_the_transaction_and_rewinds(mock: MockCluster) -> None:
    copy = Copy(mock)
    copy.feed()
    mock.push_request_errors("TxnOffsetCommit", [KafkaError.ILLEGAL_GENERATION])  # KIP-447 zombie fencing
    copy.start()
    copy.wait(lambda: copy.stats.transactions_aborted >= 1, "the transaction to be aborted")
    copy.wait_committed(N)  # read again from the committed offsets, and committed this time
    stats = copy.finish()
    assert copy.error is None
    assert stats.rewinds >= 1 and stats.producer_recreations == 0, stats


def test_fenced_at_commit_stops_with_transaction_fenced(mock: MockCluster) -> None:
    copy = Copy(mock)
    copy.feed()
    mock.push_request_errors("EndTxn", [KafkaError.PRODUCER_FENCED])
    copy.start().join()
    assert isinstance(copy.error, TransactionFenced), repr(copy.error)
    assert "fenced" in str(copy.error) and copy.tid in str(copy.error)
    assert copy.committed == 0 and copy.stats.producer_recreations == 0


def test_a_fatal_init_error_stops_with_transaction_failed(mock: MockCluster) -> None:
    copy = Copy(mock)
    mock.push_request_errors("InitProducerId", [KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED])
    copy.start().join()
    assert isinstance(copy.error, TransactionFailed) and not isinstance(copy.error, TransactionFenced), copy.error
    assert "TRANSACTIONAL_ID_AUTHORIZATION_FAILED" in str(copy.error)
    # A missing ACL, said as one: the grant it needs, and an AuthorizationFailed for `except` clauses.
    assert isinstance(copy.error, TransactionalIdAuthorizationFailed) and isinstance(copy.error, AuthorizationFailed)
    assert f"--transactional-id {copy.tid}" in str(copy.error)


# ---- the table itself -------------------------------------------------------------------------------


def _err(code: int, **flags: bool) -> KafkaException:
    return KafkaException(KafkaError(code, "test", **flags))


@pytest.mark.parametrize(
    ("operation", "error", "step"),
    [
        ("send_offsets_to_transaction", _err(KafkaError.NOT_COORDINATOR, retriable=True), TxnStep.RETRY),
        ("send_offsets_to_transaction", _err(KafkaError.CONCURRENT_TRANSACTIONS), TxnStep.RETRY),
        ("init_transactions", _err(KafkaError.COORDINATOR_NOT_AVAILABLE, retriable=True), TxnStep.RETRY),
        ("send_offsets_to_transaction", _err(KafkaError.ILLEGAL_GENERATION, txn_requires_abort=True),
         TxnStep.ABORT),
        ("commit_transaction", _err(KafkaError._INCONSISTENT, txn_requires_abort=True), TxnStep.ABORT),
        ("commit_transaction", _err(KafkaError._TIMED_OUT, retriable=True), TxnStep.RECREATE),
        ("commit_transaction", _err(KafkaError._TRANSPORT, retriable=True), TxnStep.RECREATE),
        ("commit_transaction", _err(KafkaError.NOT_COORDINATOR, retriable=True), TxnStep.RETRY),
        ("commit_transaction", _err(KafkaError._FENCED, fatal=True), TxnStep.STOP),
        ("abort_transaction", _err(KafkaError._TIMED_OUT, retriable=True), TxnStep.RETRY),
        ("abort_transaction", _err(KafkaError._STATE), TxnStep.RETRY),
        ("abort_transaction", _err(KafkaError.TOPIC_AUTHORIZATION_FAILED), TxnStep.RECREATE),
        ("abort_transaction", _err(KafkaError.INVALID_TXN_STATE, fatal=True), TxnStep.RECREATE),
        ("abort_transaction", _err(KafkaError._FENCED, fatal=True), TxnStep.STOP),
        ("produce", _err(KafkaError._STATE), TxnStep.ABORT),
        ("produce", _err(KafkaError._FATAL, fatal=True), TxnStep.ABORT),
        ("init_transactions", _err(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, fatal=True), TxnStep.STOP),
    ],
    ids=lambda v: v.name if isinstance(v, TxnStep) else None,
)
def test_next_step(operation: str, error: KafkaException, step: TxnStep) -> None:
    assert next_step(operation, error) is step


def test_a_transactions_records_linger_as_long_as_it_stays_open_unless_the_user_says_otherwise() -> None:
    """A read_committed reader sees nothing before the commit, which sends what lingers: linger.ms takes
    the commit interval (at least the producer default, at most a second) unless the user set it, under
    either of its names."""
    conn = {"bootstrap.servers": "b:9092"}
    assert transactional_producer_config(conn, "tx")["linger.ms"] == 5  # without an interval: the default
    assert transactional_producer_config(conn, "tx", commit_interval_s=0.1)["linger.ms"] == 100
    assert transactional_producer_config(conn, "tx", commit_interval_s=0.001)["linger.ms"] == 5
    assert transactional_producer_config(conn, "tx", commit_interval_s=30)["linger.ms"] == 1_000
    short = {**conn, "transaction.timeout.ms": 1_000}  # librdkafka wants linger.ms below message.timeout.ms
    assert transactional_producer_config(short, "tx", commit_interval_s=0.8)["linger.ms"] == 500
    assert transactional_producer_config({**conn, "linger.ms": 7}, "tx", commit_interval_s=0.1)["linger.ms"] == 7
    aliased = transactional_producer_config({**conn, "queue.buffering.max.ms": 9}, "tx", commit_interval_s=0.1)
    assert aliased["linger.ms"] == 9 and "queue.buffering.max.ms" not in aliased
    # The processor's: its own batch interval (the client is made later, from this config).
    processor = TransactionalProcessor({**conn, "group.id": "g"}, input_topics=["t"], transform=lambda m: [],
                                       transactional_id="tx", max_batch_interval_s=0.25)
    assert processor._checkpoint.client._config["linger.ms"] == 250


def test_transactional_config_is_checked_in_the_one_place() -> None:
    cfg = transactional_producer_config({"bootstrap.servers": "b:9092"}, "tx-1")
    assert cfg["transactional.id"] == "tx-1" and cfg["acks"] == "all" and cfg["enable.idempotence"] is True
    assert int(cfg["message.timeout.ms"]) <= int(cfg["transaction.timeout.ms"])
    with pytest.raises(ConfigError, match="message.timeout.ms"):
        transactional_producer_config(
            {"bootstrap.servers": "b:9092", "transaction.timeout.ms": 10_000, "delivery.timeout.ms": 20_000}, "tx"
        )
    with pytest.raises(ConfigError, match="transactional.id"):
        transactional_producer_config({"bootstrap.servers": "b:9092"}, " ")
    with pytest.raises(ConfigError, match="acks"):
        transactional_producer_config({"bootstrap.servers": "b:9092", "acks": 1}, "tx")
    with pytest.raises(ConfigError, match="isolation.level"):
        TransactionalProcessor({"bootstrap.servers": "b:9092", "group.id": "g"}, input_topics=["t"],
                               transform=lambda m: [], transactional_id="tx",
                               consumer_overrides={"isolation.level": "read_uncommitted"})
    with pytest.raises(ConfigError, match="stop_timeout_s"):
        TransactionalProcessor({"bootstrap.servers": "b:9092", "group.id": "g"}, input_topics=["t"],
                               transform=lambda m: [], transactional_id="tx", stop_timeout_s=0)


def test_outputs_carry_a_deterministic_rk_id(mock: MockCluster) -> None:
    copy = Copy(mock)
    copy.feed(5)
    copy.start().wait_committed(5)
    copy.finish()
    reader = _reader(mock, copy.output)
    ids = [dict(m.headers() or [])["rk-id"] for m in reader]
    assert ids == [f"{copy.source}/0/{i}:0".encode() for i in range(5)]


# Input i's headers, and what its copy must carry: the input's own rk-id passed on alone is kept as it is
# (the processor holds it as its value only), with other headers in their order, and an output with
# headers of its own but no rk-id gets the deterministic one appended.
HEADER_CASES: list[tuple[list[tuple[str, bytes | None]] | None, Callable[[str], list[tuple[str, bytes | None]]]]] = [
    ([("rk-id", b"given-0")], lambda src: [("rk-id", b"given-0")]),
    ([("app", b"a"), ("rk-id", b"given-1")], lambda src: [("app", b"a"), ("rk-id", b"given-1")]),
    ([("rk-id", None)], lambda src: [("rk-id", None)]),
    ([("app", b"b")], lambda src: [("app", b"b"), ("rk-id", f"{src}/0/3:0".encode())]),
    (None, lambda src: [("rk-id", f"{src}/0/4:0".encode())]),
]


def test_an_outputs_headers_are_kept_whatever_their_shape(mock: MockCluster) -> None:
    copy = Copy(mock, transform=lambda msg, output: [OutputRecord(output, msg.value(), headers=msg.headers())]
                if msg.headers() else [OutputRecord(output, msg.value())])
    copy.feed(len(HEADER_CASES), headers=lambda i: HEADER_CASES[i][0])
    copy.start().wait_committed(len(HEADER_CASES))
    copy.finish()
    got = [m.headers() or [] for m in _reader(mock, copy.output)]
    assert got == [expected(copy.source) for _, expected in HEADER_CASES]


def _reader(mock: MockCluster, topic: str, n: int = 5) -> list[Message]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": mock.bootstrap_servers, "group.id": f"r-{uuid.uuid4().hex[:6]}"})
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: list[Message] = []
    deadline = time.monotonic() + 10
    while len(out) < n and time.monotonic() < deadline:
        out += [m for m in consumer.consume(10, 0.5) if m.error() is None]
    consumer.close()
    return out



def test_an_old_epoch_without_a_takeover_recreates_the_producer_and_goes_on(mock: MockCluster) -> None:
    """INVALID_PRODUCER_EPOCH on TxnOffsetCommit (seen after a coordinator's broker was SIGKILLed, with no
    other instance alive): librdkafka reports _FENCED, but no newer producer said so; a new producer goes on."""
    recreates_the_producer_once_and_goes_on(Copy(mock), "TxnOffsetCommit")


def recreates_the_producer_once_and_goes_on(copy: Copy, api: str) -> None:
    """`api` answers INVALID_PRODUCER_EPOCH once: the copy recreates its producer, once, and commits everything."""
    copy.feed()
    copy.mock.push_request_errors(api, [KafkaError.INVALID_PRODUCER_EPOCH])
    copy.start()
    copy.wait(lambda: copy.stats.producer_recreations >= 1, "the producer to be recreated")
    copy.wait_committed(N)
    stats = copy.finish()
    assert copy.error is None, repr(copy.error)
    assert stats.producer_recreations == 1 and stats.transactions_aborted >= 1, stats


def test_an_old_epoch_on_produce_in_a_young_transaction_is_a_takeover_and_stops(mock: MockCluster) -> None:
    """A partition leader answers "old epoch" to a ProduceRequest only after the coordinator bumped the epoch:
    with the transaction younger than transaction.timeout.ms, a newer instance did (seen on the cluster: the
    newer one had not joined the group yet, so the old one still owned its partitions). It stops; a new
    producer would fence the newer instance."""
    copy = Copy(mock)
    copy.feed()
    mock.push_request_errors("Produce", [KafkaError.INVALID_PRODUCER_EPOCH])
    copy.start().join()
    assert isinstance(copy.error, TransactionFenced), repr(copy.error)
    assert "ProduceRequest" in str(copy.error) and copy.tid in str(copy.error), str(copy.error)
    assert copy.committed == 0 and copy.stats.producer_recreations == 0, copy.stats


def test_an_old_epoch_on_produce_after_the_transaction_timeout_recreates_the_producer(mock: MockCluster) -> None:
    """The same answer to a transaction older than transaction.timeout.ms: the coordinator may have aborted it
    for its age and bumped the epoch itself, so a new producer redoes the transaction (the instance owns its
    partitions). The mock times nothing out: the 1.5 s batch only makes the transaction older than 1 s."""
    copy = Copy(mock, batch_interval_s=1.5,
                producer_overrides={"transaction.timeout.ms": 1000, "message.timeout.ms": 1000})
    recreates_the_producer_once_and_goes_on(copy, "Produce")


@pytest.mark.parametrize(
    ("error", "bumped"),
    [
        (KafkaError(KafkaError._FENCED, KafkaError(KafkaError.INVALID_PRODUCER_EPOCH).str(), fatal=True), True),
        (KafkaError(KafkaError.INVALID_PRODUCER_EPOCH), True),
        (KafkaError(KafkaError._FENCED, KafkaError(KafkaError.PRODUCER_FENCED).str(), fatal=True), False),
        (KafkaError(KafkaError.PRODUCER_FENCED), False),
    ],
)
def test_an_old_epoch_is_told_from_a_takeover(error: KafkaError, bumped: bool) -> None:
    assert kafka_errors.epoch_bumped(KafkaException(error)) is bumped
    step = next_step("send_offsets_to_transaction", KafkaException(error))
    assert step is (TxnStep.RECREATE if bumped else TxnStep.STOP)


# ---- bad output: not bytes, no serializer -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["transform", "map_values"])
def test_an_output_that_is_not_bytes_dead_letters_its_input_with_the_fix_and_the_rest_is_copied(
        mock: MockCluster, kind: str) -> None:
    def value_of(msg: Message) -> Any:
        return 42 if msg.value() == b"v-2" else msg.value()  # an int, and no value_serializer

    if kind == "map_values":
        copy = Copy(mock, mapped=value_of)
    else:
        copy = Copy(mock, transform=lambda msg, output: [OutputRecord(output, value_of(msg), msg.key())])
    mock.create_topic(f"{copy.source}.dlq", 1)
    copy.feed(5)
    copy.start().wait_committed(5)
    stats = copy.finish()

    assert copy.error is None
    assert sorted(m.value() for m in _reader(mock, copy.output, 4)) == [b"v-0", b"v-1", b"v-3", b"v-4"]
    [dead] = _reader(mock, f"{copy.source}.dlq", 1)
    info = parse_dead_letter_headers(dead.headers())
    assert (dead.value(), info.offset) == (b"v-2", 2)
    # The error names the output's topic, what is wrong with it and the fix.
    assert copy.output in info.error and "value (int) is not bytes" in info.error and "value_serializer=" in info.error
    assert stats.dead_lettered == 1 and stats.transactions_aborted >= 1, stats
