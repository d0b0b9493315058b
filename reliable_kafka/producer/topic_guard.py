"""A producer's topic preflight and message size limits, over one AdminClient kept for its lifetime.

A topic is accepted only once its replication was checked (or, while no broker answers, its check is
deferred and retried), and a record known not to fit its topic's max.message.bytes never reaches librdkafka.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from reliable_kafka.admin import TopicDurability, admin_client, describe_topic, preflight
from reliable_kafka.config import connection_settings
from reliable_kafka.errors import (
    AuthenticationFailed,
    ClusterUnreachable,
    TopicAuthorizationFailed,
    TopicConfigError,
    TopicMissing,
)
from reliable_kafka.spool import OutboxRow

log = logging.getLogger(__name__)

# How often a preflight that could not reach the cluster is tried again.
PREFLIGHT_RETRY_S = 30.0
# How long a topic missing from the metadata is looked for again before it is called missing.
MISSING_TOPIC_GRACE_S = 2.0


def record_size(value: bytes | None, key: bytes | None, headers: Sequence[tuple[str, bytes]]) -> int:
    """A record's size in a batch of one: payload plus the v2 batch and record overhead (about 80 bytes)."""
    # + the rk-id header (5 + 36 bytes) that every record carries
    return 125 + len(value or b"") + len(key or b"") + sum(len(k) + len(v) + 4 for k, v in headers)


class TopicGuard:
    """Checks each topic once per producer and remembers what it learnt.

    `seen` and `limits` are read without a call on the hot path (send and dispatch): the front skips
    the topics in `seen`, the dispatcher compares sizes with `limits`. Only this class writes them.
    """

    def __init__(self, config: Mapping[str, Any], mode: str) -> None:
        self._connection = connection_settings(config)
        self._mode = mode
        self.seen: set[str] = set()  # topics checked, or whose check is deferred: send() does not check them
        self.limits: dict[str, int] = {}  # topic -> max.message.bytes, as last read from the cluster
        self._deferred: dict[str, float] = {}  # topic -> when its preflight last could not run
        self._admin: Any = None
        self._admin_lock = threading.Lock()

    def admin(self) -> Any:
        """The producer's one AdminClient, created on first use (a producer with preflight off and
        no size refusal never opens one)."""
        with self._admin_lock:
            if self._admin is None:
                self._admin = admin_client(self._connection["bootstrap.servers"], self._connection)
            return self._admin

    def close(self) -> None:
        # confluent-kafka's AdminClient has no close(): dropping the last reference destroys its handle.
        with self._admin_lock:
            self._admin = None

    def preflight(self, topic: str, *, deferred: bool = False) -> None:
        """Check `topic` before its first message is accepted; raises TopicConfigError (mode "error").

        When no broker answers, the check is deferred (the outbox exists to accept messages while
        brokers are away) and retry_deferred() runs it later.
        """
        try:
            described = preflight(self.admin(), topic, mode=self._mode, timeout=5)
            if described is None and self._mode != "off":
                described = self._missing(topic, deferred)
        except ClusterUnreachable as exc:
            if not deferred:
                log.warning("preflight of topic %r deferred until a broker answers: %s", topic, exc)
            self._deferred[topic] = time.monotonic()
            self.seen.add(topic)
            return
        except AuthenticationFailed as exc:
            if not deferred:
                raise  # at send(): nothing accepted, the caller fixes its credentials
            # Accepted while no broker answered: they stay pending; asked again, and said again, later.
            log.error("preflight of topic %r: %s; its messages stay pending in the outbox", topic, exc)
            self._deferred[topic] = time.monotonic()
            return
        except (TopicConfigError, TopicAuthorizationFailed) as exc:
            if not deferred:
                raise
            # Messages were accepted while the check could not run; they stay and are sent, loudly.
            log.error("%s; messages accepted while brokers were unreachable are sent anyway", exc)
            described = None  # its limit is learnt from the broker's first size refusal, if any
        self._deferred.pop(topic, None)
        self.seen.add(topic)
        if described is not None:
            self.limits[topic] = described.max_message_bytes

    def _missing(self, topic: str, deferred: bool) -> TopicDurability | None:
        """`topic` was not in the metadata: look again for a moment (a topic created just now reaches
        every broker a little later), then refuse it (mode "error") or say so once (mode "warn").

        Without this a message to a missing topic was accepted and failed minutes later as an unknown
        topic, with nothing at the call that said what to do.
        """
        deadline = time.monotonic() + MISSING_TOPIC_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.2)
            described = preflight(self.admin(), topic, mode=self._mode, timeout=5)
            if described is not None:
                return described
        missing = TopicMissing(topic)
        if self._mode == "error" and not deferred:
            raise missing
        log.warning("%s; its messages are accepted and fail as an unknown topic if it is still missing when "
                    "librdkafka gives up", missing)
        return None

    def check(self, topics: Iterable[str]) -> None:
        """Preflight `topics` now, waiting up to 10 s for a topic just created to appear in metadata.

        Raises TopicConfigError (mode "error", or a topic that never appears) and ClusterUnreachable.
        """
        admin = self.admin()
        for topic in topics:
            deadline = time.monotonic() + 10
            # A topic created a moment ago may not be in every broker's metadata yet.
            while (described := preflight(admin, topic, mode=self._mode, timeout=10)) is None:
                if time.monotonic() > deadline:
                    raise TopicMissing(topic)
                time.sleep(0.2)
            self._deferred.pop(topic, None)
            self.seen.add(topic)
            self.limits[topic] = described.max_message_bytes

    def retry_deferred(self) -> None:
        """Run the preflights deferred for PREFLIGHT_RETRY_S or longer (from the producer's poller)."""
        if not self._deferred:
            return
        now = time.monotonic()
        for topic, since in list(self._deferred.items()):
            if now - since >= PREFLIGHT_RETRY_S:
                self.preflight(topic, deferred=True)

    @property
    def deferred(self) -> list[str]:
        """Topics whose preflight waits for a broker to answer."""
        return list(self._deferred)

    def too_large(self, topic: str, value: bytes | None, key: bytes | None,
                  headers: Sequence[tuple[str, bytes]]) -> str | None:
        """Why a record cannot fit the topic's max.message.bytes, or None if it fits or the limit is unknown.

        Refusing it before librdkafka batches it matters: the broker rejects a whole batch for one
        oversized record, and its innocent neighbours would come back with the same error.
        """
        limit = self.limits.get(topic)
        if limit is None:
            return None
        size = record_size(value, key, headers)
        if size <= limit:
            return None
        return (f"MSG_SIZE_TOO_LARGE: a record of about {size} bytes exceeds max.message.bytes={limit} "
                f"of topic {topic!r}")

    def oversized(self, refused: Sequence[tuple[str, OutboxRow | None]]) -> list[bool]:
        """After the broker said MSG_SIZE_TOO_LARGE for these (topic, row) records: which are too large
        by themselves (True), and which only shared a batch with one (False)?

        The broker's word beats a cached limit (the topic may have been altered since preflight), so
        each topic's limit is read again, once per call. A record whose limit or row cannot be had
        counts as too large: the broker refused it, and sending it again would loop.
        """
        known: dict[str, bool] = {}
        out = []
        for topic, row in refused:
            if topic not in known:
                known[topic] = self._relearn_limit(topic)
            out.append(not known[topic] or row is None
                       or self.too_large(topic, row.value, row.key, row.headers) is not None)
        return out

    def _relearn_limit(self, topic: str) -> bool:
        try:
            described = describe_topic(self.admin(), topic, timeout=5)
        except (ClusterUnreachable, TopicAuthorizationFailed, AuthenticationFailed):
            return False
        if described is None:
            return False
        self.limits[topic] = described.max_message_bytes
        return True
