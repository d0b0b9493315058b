"""Run a librdkafka mock Kafka cluster in its own process, controlled by JSON lines on stdin/stdout.

The cluster lives exactly as long as this process and is destroyed on EOF, on "stop" and on SIGTERM,
so a client under test can be SIGKILLed without taking the cluster down with it.

Protocol: on start one line ``{"bootstrap_servers": "..."}``; then one JSON command per input line,
each answered by one line ``{"ok": true}`` or ``{"ok": false, "error": "..."}``. Commands::

    {"cmd": "create_topic", "topic": "t", "partitions": 1, "replication_factor": 3}
    {"cmd": "broker_down", "broker_id": 1}            (-1: every broker)
    {"cmd": "broker_up", "broker_id": 1}              (-1: every broker)
    {"cmd": "set_leader", "topic": "t", "partition": 0, "broker_id": 2}   (-1: leaderless)
    {"cmd": "push_request_errors", "api": "Produce", "errors": [19, 19]}
    {"cmd": "set_rtt", "broker_id": 1, "rtt_ms": 500}  (-1: every broker)
    {"cmd": "set_coordinator", "key_type": "transaction", "key": "tx-1", "broker_id": 2}
    {"cmd": "stop"}
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any, TextIO

from reliable_kafka import rdkafka_conf
from reliable_kafka.errors import ClusterError

log = logging.getLogger("reliable_kafka.testing.mock_server")

# Kafka protocol request types (ApiKey) a client sends; any other key can still be given as an int.
API_KEYS: dict[str, int] = {
    "Produce": 0,
    "Fetch": 1,
    "ListOffsets": 2,
    "Metadata": 3,
    "OffsetCommit": 8,
    "OffsetFetch": 9,
    "FindCoordinator": 10,
    "JoinGroup": 11,
    "Heartbeat": 12,
    "LeaveGroup": 13,
    "SyncGroup": 14,
    "DescribeGroups": 15,
    "ListGroups": 16,
    "SaslHandshake": 17,
    "ApiVersions": 18,
    "CreateTopics": 19,
    "DeleteTopics": 20,
    "DeleteRecords": 21,
    "InitProducerId": 22,
    "OffsetForLeaderEpoch": 23,
    "AddPartitionsToTxn": 24,
    "AddOffsetsToTxn": 25,
    "EndTxn": 26,
    "WriteTxnMarkers": 27,
    "TxnOffsetCommit": 28,
    "DescribeConfigs": 32,
    "AlterConfigs": 33,
    "SaslAuthenticate": 36,
    "CreatePartitions": 37,
    "DeleteGroups": 42,
    "IncrementalAlterConfigs": 44,
    "OffsetDelete": 47,
    "DescribeCluster": 60,
    "DescribeProducers": 61,
    "DescribeTransactions": 65,
    "ListTransactions": 66,
    "ConsumerGroupHeartbeat": 68,
    "GetTelemetrySubscriptions": 71,
    "PushTelemetry": 72,
}
_API_KEYS_BY_LOWER_NAME = {name.lower(): key for name, key in API_KEYS.items()}
_INT16_MAX = 32_767

COORDINATOR_KEY_TYPES = ("transaction", "group")

ALL_BROKERS = -1

# librdkafka constants (rdkafka.h).
_RD_KAFKA_PRODUCER = 0
_RD_KAFKA_CONF_OK = 0
_ERRSTR_SIZE = 512


def api_key(api: str | int) -> int:
    """The protocol ApiKey for a request name such as "Produce" (any case) or an int ApiKey."""
    if isinstance(api, bool):
        raise ValueError(f"ApiKey must be a request name or an int, got {api!r}")
    if isinstance(api, int):
        if not 0 <= api <= _INT16_MAX:
            raise ValueError(f"ApiKey {api} is outside 0..{_INT16_MAX}")
        return api
    if isinstance(api, str):
        key = _API_KEYS_BY_LOWER_NAME.get(api.lower())
        if key is None:
            known = ", ".join(API_KEYS)
            raise ValueError(f"unknown request name {api!r}; known: {known} (or pass the int ApiKey)")
        return key
    raise ValueError(f"ApiKey must be a request name or an int, got {api!r}")


def error_codes(errors: Sequence[int]) -> list[int]:
    """The error codes as a non-empty list of ints, or ValueError saying what is wrong."""
    codes = list(errors)
    if not codes:
        raise ValueError("errors is empty: give at least one error code")
    if any(isinstance(e, bool) or not isinstance(e, int) for e in codes):
        raise ValueError(f"errors must be int error codes (confluent_kafka.KafkaError.<NAME>), got {codes!r}")
    return [int(e) for e in codes]


def find_librdkafka() -> str:
    """Path of the librdkafka inside the confluent-kafka wheel, else a system librdkafka."""
    path = rdkafka_conf.find_librdkafka()
    if path is None:
        raise ClusterError(
            "librdkafka not found: neither inside the confluent-kafka wheel nor on the system; "
            "install confluent-kafka from its binary wheel (pip install confluent-kafka)"
        )
    return path


def _bind(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
    try:
        function = getattr(lib, name)
    except AttributeError:
        raise ClusterError(
            f"{lib._name} has no {name}: this librdkafka lacks the mock cluster API "
            "(use the librdkafka bundled with confluent-kafka >= 2.12)"
        ) from None
    function.restype = restype
    function.argtypes = argtypes
    return function


# The librdkafka versions whose mock API (rdkafka_mock.h, not a stable ABI) these ctypes signatures were
# checked against. The runtime dependency on confluent-kafka has no upper bound for this test tool's
# sake: the mock refuses a librdkafka outside the range instead, saying what to do.
TESTED_LIBRDKAFKA = ((2, 12), (2, 16))


def check_librdkafka_version(version: str) -> None:
    """Refuse a librdkafka whose mock API these signatures were not checked against (RK_MOCK_ANY_LIBRDKAFKA=1
    tries anyway)."""
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    low, high = TESTED_LIBRDKAFKA
    if not low <= major_minor <= high and os.environ.get("RK_MOCK_ANY_LIBRDKAFKA") != "1":
        raise ClusterError(
            f"the mock cluster binds librdkafka's mock API through ctypes and was checked against librdkafka "
            f"{low[0]}.{low[1]} to {high[0]}.{high[1]}; this is {version}: install confluent-kafka>={low[0]}.{low[1]},"
            f"<{high[0]}.{high[1] + 1} where the mock tests run, or set RK_MOCK_ANY_LIBRDKAFKA=1 to try it anyway"
        )


class _Librdkafka:
    """ctypes signatures of the librdkafka functions the mock cluster needs (rdkafka.h, rdkafka_mock.h)."""

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise ClusterError(f"cannot load librdkafka from {path}: {exc}") from exc
        # The version of the library loaded here (a system one may differ from the binding's).
        check_librdkafka_version(_bind(lib, "rd_kafka_version_str", ctypes.c_char_p, [])().decode())
        p, s, i, i16, i32 = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int16, ctypes.c_int32
        size = ctypes.c_size_t
        self.path = path
        self.conf_new = _bind(lib, "rd_kafka_conf_new", p, [])
        self.conf_set = _bind(lib, "rd_kafka_conf_set", i, [p, s, s, s, size])
        self.conf_destroy = _bind(lib, "rd_kafka_conf_destroy", None, [p])
        self.new = _bind(lib, "rd_kafka_new", p, [i, p, s, size])
        self.destroy = _bind(lib, "rd_kafka_destroy", None, [p])
        self.err2name = _bind(lib, "rd_kafka_err2name", s, [i])
        self.err2str = _bind(lib, "rd_kafka_err2str", s, [i])
        self.cluster_new = _bind(lib, "rd_kafka_mock_cluster_new", p, [p, i])
        self.cluster_destroy = _bind(lib, "rd_kafka_mock_cluster_destroy", None, [p])
        self.cluster_bootstraps = _bind(lib, "rd_kafka_mock_cluster_bootstraps", s, [p])
        self.topic_create = _bind(lib, "rd_kafka_mock_topic_create", i, [p, s, i, i])
        self.broker_set_down = _bind(lib, "rd_kafka_mock_broker_set_down", i, [p, i32])
        self.broker_set_up = _bind(lib, "rd_kafka_mock_broker_set_up", i, [p, i32])
        self.broker_set_rtt = _bind(lib, "rd_kafka_mock_broker_set_rtt", i, [p, i32, i])
        self.partition_set_leader = _bind(lib, "rd_kafka_mock_partition_set_leader", i, [p, s, i32, i32])
        self.push_request_errors_array = _bind(
            lib, "rd_kafka_mock_push_request_errors_array", None, [p, i16, size, ctypes.POINTER(i)]
        )
        self.coordinator_set = _bind(lib, "rd_kafka_mock_coordinator_set", i, [p, s, s, i32])

    def describe(self, err: int) -> str:
        name = (self.err2name(err) or b"?").decode()
        text = (self.err2str(err) or b"").decode()
        return f"{name} ({text})"


class MockClusterHandle:
    """One librdkafka mock cluster in this process, plus the rd_kafka_t it needs for book keeping."""

    def __init__(self, brokers: int, library: str | None = None) -> None:
        if brokers < 1:
            raise ValueError(f"brokers must be at least 1, got {brokers}")
        self.brokers = brokers
        self._lib = _Librdkafka(library or find_librdkafka())
        self._rk = self._new_handle()
        self._mcluster = self._lib.cluster_new(self._rk, brokers)
        if not self._mcluster:
            self._lib.destroy(self._rk)
            raise ClusterError(f"rd_kafka_mock_cluster_new failed for {brokers} brokers (see librdkafka log)")
        self.bootstrap_servers: str = self._lib.cluster_bootstraps(self._mcluster).decode()

    def _new_handle(self) -> int:
        lib = self._lib
        errstr = ctypes.create_string_buffer(_ERRSTR_SIZE)
        conf = lib.conf_new()
        # This handle never connects: log warnings only, so its "no bootstrap.servers" notice stays quiet.
        for key, value in (("client.id", "reliable-kafka-mock-cluster"), ("log_level", "4")):
            if lib.conf_set(conf, key.encode(), value.encode(), errstr, _ERRSTR_SIZE) != _RD_KAFKA_CONF_OK:
                lib.conf_destroy(conf)
                raise ClusterError(f"rd_kafka_conf_set({key}={value}) failed: {errstr.value.decode()}")
        rk = lib.new(_RD_KAFKA_PRODUCER, conf, errstr, _ERRSTR_SIZE)
        if not rk:
            # rd_kafka_new takes ownership of conf only on success.
            lib.conf_destroy(conf)
            raise ClusterError(f"rd_kafka_new failed: {errstr.value.decode()}")
        return int(rk)

    def close(self) -> None:
        """Destroy the cluster (its listeners close) and then the handle; safe to call twice."""
        if self._mcluster:
            self._lib.cluster_destroy(self._mcluster)
            self._mcluster = None
        if self._rk:
            self._lib.destroy(self._rk)
            self._rk = 0

    def _check(self, what: str, err: int) -> None:
        if err != 0:
            raise ClusterError(f"{what} failed: {self._lib.describe(err)}")

    def _check_broker(self, broker_id: int) -> None:
        if broker_id != ALL_BROKERS and not 1 <= broker_id <= self.brokers:
            raise ValueError(f"no broker {broker_id}: brokers are 1..{self.brokers} (or -1 for all)")

    def create_topic(self, topic: str, partitions: int, replication_factor: int) -> None:
        if partitions < 1:
            raise ValueError(f"partitions must be at least 1, got {partitions}")
        # The mock silently caps the replication factor at the broker count; refuse instead, like Kafka.
        if not 1 <= replication_factor <= self.brokers:
            raise ValueError(f"replication_factor {replication_factor} is outside 1..{self.brokers} brokers")
        err = self._lib.topic_create(self._mcluster, topic.encode(), partitions, replication_factor)
        self._check(f"create_topic({topic!r})", err)

    def broker_down(self, broker_id: int) -> None:
        self._check_broker(broker_id)
        self._check(f"broker_down({broker_id})", self._lib.broker_set_down(self._mcluster, broker_id))

    def broker_up(self, broker_id: int) -> None:
        self._check_broker(broker_id)
        self._check(f"broker_up({broker_id})", self._lib.broker_set_up(self._mcluster, broker_id))

    def set_rtt(self, broker_id: int, rtt_ms: int) -> None:
        self._check_broker(broker_id)
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
        self._check(f"set_rtt({broker_id})", self._lib.broker_set_rtt(self._mcluster, broker_id, rtt_ms))

    def set_leader(self, topic: str, partition: int, broker_id: int) -> None:
        err = self._lib.partition_set_leader(self._mcluster, topic.encode(), partition, broker_id)
        self._check(f"set_leader({topic!r}, {partition}, {broker_id})", err)

    def push_request_errors(self, api: str | int, errors: Sequence[int]) -> None:
        key = api_key(api)
        codes = error_codes(errors)
        array = (ctypes.c_int * len(codes))(*codes)
        self._lib.push_request_errors_array(self._mcluster, key, len(codes), array)

    def set_coordinator(self, key_type: str, key: str, broker_id: int) -> None:
        if key_type not in COORDINATOR_KEY_TYPES:
            raise ValueError(f"key_type must be one of {COORDINATOR_KEY_TYPES}, got {key_type!r}")
        err = self._lib.coordinator_set(self._mcluster, key_type.encode(), key.encode(), broker_id)
        self._check(f"set_coordinator({key_type!r}, {key!r}, {broker_id})", err)


# Each command's argument names and types; the wire format is checked here, once, before any C call.
_COMMANDS: dict[str, dict[str, type]] = {
    "create_topic": {"topic": str, "partitions": int, "replication_factor": int},
    "broker_down": {"broker_id": int},
    "broker_up": {"broker_id": int},
    "set_leader": {"topic": str, "partition": int, "broker_id": int},
    "push_request_errors": {"api": object, "errors": list},
    "set_rtt": {"broker_id": int, "rtt_ms": int},
    "set_coordinator": {"key_type": str, "key": str, "broker_id": int},
}


def _arguments(command: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    name = command.get("cmd")
    if not isinstance(name, str) or name not in _COMMANDS:
        raise ValueError(f"unknown command {name!r}; known: {', '.join(_COMMANDS)}, stop")
    spec = _COMMANDS[name]
    args = {k: v for k, v in command.items() if k != "cmd"}
    if set(args) != set(spec):
        raise ValueError(f"{name} takes {sorted(spec)}, got {sorted(args)}")
    for arg, kind in spec.items():
        value = args[arg]
        # bool is an int subclass, but True as a broker id is a caller bug.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{name}: {arg} must be {kind.__name__}, got {value!r}")
    return name, args


def execute(handle: MockClusterHandle, command: Mapping[str, Any]) -> None:
    """Run one decoded command on the cluster; raises ValueError or ClusterError when it cannot."""
    name, args = _arguments(command)
    getattr(handle, name)(**args)


def _answer(out: TextIO, reply: Mapping[str, Any]) -> None:
    out.write(json.dumps(reply) + "\n")
    out.flush()


def serve(handle: MockClusterHandle, commands: TextIO, out: TextIO) -> None:
    """Answer commands until EOF or "stop"; the caller destroys the cluster afterwards."""
    _answer(out, {"bootstrap_servers": handle.bootstrap_servers})
    while True:
        line = commands.readline()
        if not line:
            log.info("stdin closed: stopping")
            return
        if not line.strip():
            continue
        try:
            try:
                command = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON command ({exc}): {line.strip()!r}") from None
            if not isinstance(command, dict):
                raise ValueError(f"a command is a JSON object, got {line.strip()!r}")
            if command.get("cmd") == "stop":
                _answer(out, {"ok": True})
                log.info("stop requested")
                return
            execute(handle, command)
        except (ValueError, ClusterError) as exc:
            log.warning("refused %s: %s", line.strip(), exc)
            _answer(out, {"ok": False, "error": str(exc)})
        else:
            log.debug("done %s", line.strip())
            _answer(out, {"ok": True})


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Raising SystemExit unwinds through serve()'s blocking readline into the finally below.
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reliable_kafka.testing.mock_server",
        description="librdkafka mock Kafka cluster driven by JSON lines on stdin (client error paths only).",
    )
    parser.add_argument("--brokers", type=int, default=3, help="number of mock brokers (ids 1..N)")
    parser.add_argument("--library", default=None, help="librdkafka path (default: the confluent-kafka one)")
    parser.add_argument("--log-level", default="INFO", help="logging level on stderr")
    options = parser.parse_args(argv)
    logging.basicConfig(
        level=options.log_level.upper(), stream=sys.stderr, format="mock_server %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        handle = MockClusterHandle(options.brokers, options.library)
    except (ValueError, ClusterError) as exc:
        log.error("cannot start the mock cluster: %s", exc)
        return 2
    log.info("mock cluster of %d brokers at %s", options.brokers, handle.bootstrap_servers)
    try:
        serve(handle, sys.stdin, sys.stdout)
    finally:
        # A second SIGTERM must not interrupt the C destructors half-way.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        handle.close()
        log.info("mock cluster destroyed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
