"""One exception tree: every public exception class of the package is a ReliableKafkaError and is exported
from `reliable_kafka`, so `except reliable_kafka.X` works for anything a public call raises."""

from __future__ import annotations

import importlib
import pickle
import pkgutil

import pytest

import reliable_kafka
from reliable_kafka import errors

# Exception classes not in the tree yet, in modules another change is rewriting; remove each when it moves
# to errors.py. The test below fails when one disappears, so this list cannot outlive its reason.
NOT_YET_IN_THE_TREE = {"reliable_kafka.testing.gates.FaultNotArmed"}


def _exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined in the package, by qualified name; `_private` ones never leave it."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(reliable_kafka.__path__, "reliable_kafka."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == info.name
                    and not name.startswith("_")):
                found[f"{info.name}.{name}"] = value
    return found


CLASSES = _exception_classes()


def test_the_walk_finds_the_tree() -> None:
    assert "reliable_kafka.errors.TransactionFenced" in CLASSES
    assert CLASSES.keys() >= NOT_YET_IN_THE_TREE, "moved into the tree? remove it from NOT_YET_IN_THE_TREE"


@pytest.mark.parametrize("qualname", sorted(CLASSES.keys() - NOT_YET_IN_THE_TREE))
def test_every_exception_is_in_the_tree_and_exported(qualname: str) -> None:
    cls = CLASSES[qualname]
    assert issubclass(cls, reliable_kafka.ReliableKafkaError)
    assert getattr(reliable_kafka, cls.__name__) is cls
    assert cls.__name__ in reliable_kafka.__all__


# Each existing class keeps the bases it had (a user's `except` clause keeps catching it); the branches
# say what the caller does next.
@pytest.mark.parametrize(
    ("cls", "bases"),
    [
        (errors.ConfigError, (errors.InputRefused, ValueError)),
        (errors.SerializationError, (errors.InputRefused, TypeError)),
        (errors.DeserializationError, (errors.InputRefused, ValueError)),
        (errors.TopicConfigError, (errors.InputRefused,)),
        (errors.WriteRefused, (errors.InputRefused,)),
        (errors.ClusterUnreachable, (errors.Unavailable,)),
        (errors.CommitFailed, (errors.Unavailable,)),
        (errors.DedupStoreUnavailable, (errors.Unavailable,)),
        (errors.ReadIncomplete, (errors.Unavailable,)),
        (errors.OutboxFull, (errors.OutboxError, errors.Unavailable)),
        (errors.OutboxCorrupt, (errors.OutboxError,)),
        (errors.OutboxLocked, (errors.OutboxError,)),
        (errors.DeliveryFailed, (errors.RefusedByKafka,)),
        (errors.TransactionFenced, (errors.RefusedByKafka,)),
        (errors.TransactionFailed, (errors.RefusedByKafka,)),
        (errors.ProducerClosed, (errors.ClientClosed,)),
        (errors.MissingExtra, (ModuleNotFoundError,)),
    ],
)
def test_branches(cls: type[BaseException], bases: tuple[type[BaseException], ...]) -> None:
    for base in (errors.ReliableKafkaError, *bases):
        assert issubclass(cls, base), base


def test_where_an_error_has_no_topic_partition_or_code_they_are_none() -> None:
    exc = errors.CommitFailed("no broker")
    assert (exc.code, exc.topic, exc.partition) == (None, None, None)
    refused = errors.DeliveryFailed("id-1", "MSG_SIZE_TOO_LARGE", topic="orders", partition=3)
    assert (refused.topic, refused.partition, refused.code) == ("orders", 3, None)
    assert errors.TopicConfigError("orders", ["min.insync.replicas=1"]).topic == "orders"


def test_the_attributes_survive_pickling() -> None:
    # Spark sends a task's exception to the driver pickled.
    exc = errors.ReadIncomplete("orders[2]: gone", code="OFFSET_OUT_OF_RANGE", topic="orders", partition=2)
    back = pickle.loads(pickle.dumps(exc))
    assert (type(back), str(back), back.code, back.topic, back.partition) == (
        errors.ReadIncomplete, "orders[2]: gone", "OFFSET_OUT_OF_RANGE", "orders", 2)


@pytest.mark.parametrize("exc", [
    errors.ConfigError("acks", "must be all"),
    errors.TopicMissing("orders"),
    errors.TopicAuthorizationFailed("orders", "Write"),
    errors.ClusterAuthorizationFailed("IdempotentWrite"),
    errors.GroupAuthorizationFailed("billing"),
    errors.AuthenticationFailed("alice", "SCRAM-SHA-512", "invalid credentials"),
    errors.TransactionalIdAuthorizationFailed("rk-spark-w-0", "init_transactions", "denied", prefix="rk-spark-"),
    errors.MissingExtra("redis", "RedisDedupStore", "redis"),
], ids=lambda exc: type(exc).__name__)
def test_errors_whose_constructor_takes_other_arguments_survive_pickling_too(exc: Exception) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc) and vars(back) == vars(exc)


def test_authorization_errors_name_the_grant_and_never_a_secret() -> None:
    spark = errors.TransactionalIdAuthorizationFailed("rk-spark-w-0", "init_transactions", "denied", prefix="rk-spark-")
    assert "--transactional-id rk-spark- --resource-pattern-type prefixed" in str(spark)
    assert isinstance(spark, errors.TransactionFailed) and isinstance(spark, errors.AuthorizationFailed)
    denied = errors.TopicAuthorizationFailed("orders", "Write")
    assert "--operation Describe --operation Write --topic orders" in str(denied)
    assert "--operation Read --group billing" in str(errors.GroupAuthorizationFailed("billing"))
    login = errors.AuthenticationFailed("alice", "PLAIN", "invalid credentials")
    assert (login.username, login.mechanism) == ("alice", "PLAIN") and "sasl.password" in str(login)


def test_missing_extra_is_an_import_error_naming_the_module() -> None:
    exc = errors.MissingExtra("redis", "RedisDedupStore", "redis")
    assert isinstance(exc, ImportError) and exc.name == "redis"
    assert str(exc).endswith("pip install 'reliable-kafka[redis]'")
