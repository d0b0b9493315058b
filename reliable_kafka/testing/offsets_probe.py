"""OffsetsProbe: where a topic and a group stand (stable end offsets, committed offsets, open transactions).

Its clients stay open across questions, so a fault gate that asks many times a second pays client
start-up, login and coordinator lookup once; every answer is still read from the brokers at the time asked.
"""

from __future__ import annotations

import threading
import uuid
from types import TracebackType
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from reliable_kafka.retry import retry_kafka_call
from reliable_kafka.testing.child_connection import Connection, connection_of

_READ_UNCOMMITTED = "read_uncommitted"
_READ_COMMITTED = "read_committed"
# uncommitted_records() is a gate's look, asked again a moment later: it gives up sooner than a question
# whose answer is awaited.
_LOOK_TIMEOUT_S = 10.0


class OffsetsProbe:
    """Answers "end offsets of topic T", "committed offsets of group G", "records of open transactions
    in T" over clients it keeps open until close() (or the end of its `with` block).

    End offsets are stable ones (read_committed: the last stable offset, where open transactions begin),
    so a group's lag counts only records a read_committed reader can see. Committed offsets are asked
    through one consumer per group that carries the group's id but never subscribes: it reads the
    group's offsets without joining the group, so it never takes partitions from the group's members.
    Coordinator and leader errors (a group's coordinator still loading, a broker being bounced) are
    retried for `deadline_s`, each request bounded by `timeout_s`. Safe to share between threads (a
    Feeder's and a gate's): one question at a time.
    `cluster`: the connection settings, or an open cluster's bootstrap servers.
    """

    def __init__(self, cluster: str | Connection, *, timeout_s: float = 30.0, deadline_s: float = 90.0) -> None:
        self._connection = connection_of(cluster)
        self._timeout_s, self._deadline_s = timeout_s, deadline_s
        self._clients: dict[tuple[str, str], Consumer] = {}
        self._lock = threading.RLock()  # one question at a time; clients made and closed under it too
        self._closed = False

    def __enter__(self) -> OffsetsProbe:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, {}
        for client in clients.values():
            client.close()

    def end_offsets(self, topic: str) -> dict[int, int]:
        """Per partition of `topic`, its last stable offset: the first offset of the oldest transaction still
        open there, else the high watermark."""
        return self._ends(topic, _READ_COMMITTED, "end offsets")

    def high_watermarks(self, topic: str) -> dict[int, int]:
        """Per partition of `topic`, its high watermark: every record written there, records of open and
        aborted transactions and transaction markers included (a gate's look at whether a writer has begun)."""
        return self._ends(topic, _READ_UNCOMMITTED, "high watermarks")

    def _ends(self, topic: str, isolation: str, what: str) -> dict[int, int]:
        """Per partition of `topic`, its end as a client of `isolation` sees it."""
        with self._lock:
            client = self._client(isolation)

            def ends() -> dict[int, int]:
                return {p: self._end(client, topic, p, self._timeout_s)
                        for p in self._partitions(client, topic, self._timeout_s)}

            # Asked while a broker is being bounced too: a request cut off by the kill is asked again.
            return retry_kafka_call(ends, deadline_s=self._deadline_s, what=f"{what} of {topic}")

    def committed(self, group: str, topic: str, partitions: list[int]) -> dict[int, int]:
        """Per partition, the offset `group` committed on `topic` (0 where it committed none)."""
        with self._lock:
            client = self._client(_READ_COMMITTED, group)
            parts = [TopicPartition(topic, p) for p in partitions]
            # A new group's coordinator may still be loading, or moving while a broker is down.
            found = retry_kafka_call(lambda: client.committed(parts, timeout=self._timeout_s),
                                     deadline_s=self._deadline_s, what=f"committed offsets of {group}")
        return {tp.partition: max(tp.offset, 0) for tp in found}

    def group_lags(self, group: str, topic: str) -> dict[int, int]:
        """Per partition of `topic`, the records `group` has not committed yet (stable offsets: open
        transactions resolved)."""
        with self._lock:
            ends = self.end_offsets(topic)
            done = self.committed(group, topic, list(ends))
        return {p: end - done.get(p, 0) for p, end in ends.items()}

    def group_lag(self, group: str, topic: str) -> int:
        """Records of `topic` that `group` has not committed yet (stable offsets: open transactions resolved)."""
        return sum(self.group_lags(group, topic).values())

    def uncommitted_records(self, topic: str) -> int:
        """How many offsets of `topic` lie past its last stable offset: records (and markers) of transactions
        still open. A fault test aims its kill at a moment when this is > 0, so the kill leaves an open
        transaction with data behind; 0 when the topic does not exist yet or the brokers did not answer."""
        with self._lock:
            latest, stable = self._client(_READ_UNCOMMITTED), self._client(_READ_COMMITTED)
            try:
                parts = self._partitions(latest, topic, _LOOK_TIMEOUT_S)
                # High watermarks first, then stable offsets: an offset below the first that is still past
                # the second was written before the look and is still undecided after it. Asked the other
                # way round, a transaction opened between the two looks would count although none was open
                # at the first.
                highs = {p: self._end(latest, topic, p, _LOOK_TIMEOUT_S) for p in parts}
                stables = {p: self._end(stable, topic, p, _LOOK_TIMEOUT_S) for p in parts}
            except KafkaException:
                return 0
        return sum(max(0, high - stables[p]) for p, high in highs.items())

    def _client(self, isolation_level: str, group: str | None = None) -> Consumer:
        """The open client for these settings; made on first use. `group`: the group whose offsets it reads
        (its id; it never subscribes), or None for a client that only asks for end offsets."""
        if self._closed:
            raise RuntimeError("this OffsetsProbe is closed: open a new one")
        key = (isolation_level, group or "")
        client = self._clients.get(key)
        if client is None:
            settings: dict[str, Any] = {
                **self._connection,
                # A group id is required of every consumer; a probe's own one is never joined or committed to.
                "group.id": group if group is not None else f"rk-probe-{uuid.uuid4().hex[:8]}",
                "isolation.level": isolation_level,
                "enable.auto.commit": False,
            }
            client = self._clients[key] = Consumer(settings)
        return client

    @staticmethod
    def _partitions(client: Consumer, topic: str, timeout_s: float) -> list[int]:
        meta = client.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            # No partitions is no answer, not an empty topic.
            raise KafkaException(meta.error if meta is not None and meta.error is not None
                                 else KafkaError(KafkaError.LEADER_NOT_AVAILABLE))
        return sorted(meta.partitions)

    @staticmethod
    def _end(client: Consumer, topic: str, partition: int, timeout_s: float) -> int:
        # ListOffsets honours the client's isolation level: the high watermark, or the last stable offset.
        _low, high = client.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s, cached=False)
        return int(high)


def group_lags(cluster: str | Connection, group: str, topic: str) -> dict[int, int]:
    """OffsetsProbe.group_lags asked once, over clients opened for it: for a single look, not a poll."""
    with OffsetsProbe(cluster) as probe:
        return probe.group_lags(group, topic)


def group_lag(cluster: str | Connection, group: str, topic: str) -> int:
    """OffsetsProbe.group_lag asked once, over clients opened for it: for a single look, not a poll."""
    with OffsetsProbe(cluster) as probe:
        return probe.group_lag(group, topic)


def uncommitted_records(cluster: str | Connection, topic: str) -> int:
    """OffsetsProbe.uncommitted_records asked once, over clients opened for it: for a single look, not a poll."""
    with OffsetsProbe(cluster) as probe:
        return probe.uncommitted_records(topic)


__all__ = ["OffsetsProbe", "group_lag", "group_lags", "uncommitted_records"]
