"""ReliableConsumer's configuration: CommitPolicy and DedupPolicy, the flat arguments they replace (still
accepted for this release, with a DeprecationWarning naming the replacement), and the processing strategy
run() picks once from them. No broker: the client is created but never polled.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import reliable_kafka
from reliable_kafka import (
    CommitPolicy,
    ConfigError,
    DeadLetterPolicy,
    DedupPolicy,
    ReliableConsumer,
    SQLiteDedupStore,
)
from reliable_kafka.consumer import strategies
from reliable_kafka.consumer.commits import CommitCoordinator
from reliable_kafka.consumer.dedup_stage import DedupStage
from reliable_kafka.consumer.failures import DeadLetters, FailureStages
from reliable_kafka.consumer.fetcher import Fetcher
from reliable_kafka.consumer.rebalance import RebalanceHandler
from reliable_kafka.retry import RetryPolicy
from reliable_kafka.stats import Counters

T = "orders"
NOWHERE = {"bootstrap.servers": "127.0.0.1:9", "group.id": "policies"}  # never contacted


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteDedupStore]:
    s = SQLiteDedupStore(tmp_path / "dedup.db")
    yield s
    s.close()


def consumer(**kwargs: object) -> ReliableConsumer:
    c = ReliableConsumer(NOWHERE, [T], **kwargs)  # type: ignore[arg-type]
    c.close(0.1)  # nothing below fetches
    return c


def test_the_old_import_paths_still_work() -> None:
    from reliable_kafka.consumer import DeadLetterPolicy as Old
    from reliable_kafka.consumer import ReliableConsumer as OldConsumer

    assert Old is DeadLetterPolicy is reliable_kafka.dlq.DeadLetterPolicy
    assert OldConsumer is ReliableConsumer


def test_the_policies_are_taken_without_a_warning(store: SQLiteDedupStore) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = consumer(commit=CommitPolicy(interval_s=0.2, every=100), dedup=DedupPolicy(store, lease_s=5))
    assert c.dedup_key_of(_record(b"rk-1")) == "rk-1"


@pytest.mark.parametrize(("old", "new"), [
    ({"commit_interval_s": 0.2}, "commit=CommitPolicy(interval_s=...)"),
    ({"commit_every": 10, "commit_timeout_s": 5}, "commit=CommitPolicy(every=..., timeout_s=...)"),
])
def test_the_flat_commit_arguments_warn_and_name_the_replacement(old: dict[str, object], new: str) -> None:
    with pytest.warns(DeprecationWarning, match=r"pass " + _escaped(new)) as caught:
        consumer(**old)
    assert caught[0].filename == __file__  # pointing at the caller, not at the library


def test_a_bare_store_and_the_flat_dedup_arguments_warn_and_still_dedup(store: SQLiteDedupStore) -> None:
    expected = ("ReliableConsumer(dedup=store, dedup_lease_s=..., dedup_key=...) is deprecated and will be "
                "removed in the next release: pass dedup=DedupPolicy(store, lease_s=..., key=...) instead")
    with pytest.warns(DeprecationWarning, match=_escaped(expected)):
        c = consumer(dedup=store, dedup_lease_s=5, dedup_key=lambda m: "mine")
    assert c.dedup_key_of(_record(b"rk-1")) == "mine"


def test_a_key_function_without_a_store_still_sets_dedup_key_of() -> None:
    with pytest.warns(DeprecationWarning, match=_escaped("ReliableConsumer(dedup_key=...)")):
        c = consumer(dedup_key=lambda m: "mine")
    assert c.dedup_key_of(_record(b"rk-1")) == "mine"


def test_a_policy_and_its_flat_arguments_together_are_refused(store: SQLiteDedupStore) -> None:
    with pytest.raises(ConfigError, match=_escaped("commit: pass CommitPolicy(...) or commit_every=..., not both")):
        consumer(commit=CommitPolicy(), commit_every=10)
    with pytest.raises(ConfigError, match=_escaped("dedup: pass DedupPolicy(...) or dedup_fail_open=..., not both")):
        consumer(dedup=DedupPolicy(store), dedup_fail_open=True)


def test_an_unknown_argument_is_still_a_type_error() -> None:
    with pytest.raises(TypeError, match="commit_intervl_s"):
        consumer(commit_intervl_s=1)


def test_policies_refuse_values_that_cannot_work(store: SQLiteDedupStore) -> None:
    with pytest.raises(ConfigError, match="CommitPolicy.interval_s"):
        CommitPolicy(interval_s=-1)
    with pytest.raises(ConfigError, match="DedupPolicy.lease_s"):
        DedupPolicy(store, lease_s=0)
    with pytest.raises(ConfigError, match="DedupPolicy.store.*pass dedup=None"):
        DedupPolicy(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(("batch", "concurrency", "tracing", "dedup", "expected", "bare"), [
    (False, 1, False, False, strategies.FastStrategy, None),
    (False, 1, True, False, strategies.RecordStrategy, None),
    (True, 1, False, False, strategies.BatchStrategy, None),
    (False, 4, False, False, strategies.ConcurrentStrategy, None),
    (True, 4, False, False, strategies.ConcurrentStrategy, None),
    (False, 1, False, True, strategies.ClaimedStrategy, True),
    (False, 1, True, True, strategies.ClaimedStrategy, False),
    (True, 1, False, True, strategies.ClaimedStrategy, False),
])
def test_run_picks_one_strategy_from_its_settings(store: SQLiteDedupStore, batch: bool, concurrency: int,
                                                  tracing: bool, dedup: bool, expected: type,
                                                  bare: bool | None) -> None:
    counters, client = Counters(), object()
    stage = DedupStage(DedupPolicy(store), counters) if dedup else None
    commits = CommitCoordinator(client, CommitPolicy(), counters, group="g")  # type: ignore[arg-type]
    rebalance = RebalanceHandler(client, commits, revoke_timeout_s=1)  # type: ignore[arg-type]
    fetcher = Fetcher(client, commits.tracker, rebalance, stage, max_batch=10, max_in_flight=10)  # type: ignore[arg-type]
    failures = FailureStages(RetryPolicy(), DeadLetters(None, {}), commits, stage, counters, threading.Event(),
                             tracing=tracing, group="g")
    picked = strategies.choose(lambda m: None, batch=batch, concurrency=concurrency, tracing=tracing,
                               dedup=stage, single_topic=T, fetcher=fetcher, failures=failures,
                               commits=commits, counters=counters)
    try:
        assert type(picked) is expected
        if bare is not None:
            assert picked._bare is bare  # type: ignore[union-attr]
    finally:
        picked.close(0.1)


def _record(rk_id: bytes):  # type: ignore[no-untyped-def]
    from confluent_kafka import Message

    return Message(topic=T, partition=0, offset=0, headers=[("rk-id", rk_id)])


def _escaped(text: str) -> str:
    import re

    return re.escape(text)
