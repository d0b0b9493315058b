"""Redis dedup store: each key is one Redis string holding ``claim:<owner>`` or ``done``, with a TTL.

Claim, confirm and release are one Lua script call per batch (one round trip, atomic on the server), inbox
mode applies the application's Redis writes and the confirmation in one MULTI/EXEC, and any Redis failure
raises DedupStoreUnavailable within the socket timeout instead of hanging.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from reliable_kafka.dedup.base import (
    DEFAULT_RETENTION_S,
    ClaimResult,
    DedupStore,
    distinct_keys,
    lease_ms,
    retention_ms,
)
from reliable_kafka.errors import DedupStoreUnavailable
from reliable_kafka.extras import needs_extra

with needs_extra("redis", "RedisDedupStore"):
    import redis
    from redis.backoff import NoBackoff
    from redis.client import Pipeline
    from redis.retry import Retry

logger = logging.getLogger(__name__)

_DONE = "done"

# The batch travels as ONE argument, its keys joined by newlines, and the Lua side prefixes and splits it:
# packing 10k separate arguments costs redis-py more than the server spends on the whole batch.
# KEYS[1] is the prefix only to route the call on Redis Cluster (see the class notes).
# ARGV: 1 = the newline-terminated keys, 2 = this owner's claim value, 3 = done value, 4 = lease/retention ms.

# Per key: SET NX PX takes a free (or expired) key; otherwise the value says done or busy. An owner's
# own live claim is busy too, so threads sharing one store never run the same key twice.
# One string of c/d/b letters comes back: cheaper to parse than an array of 10k replies.
_CLAIM_LUA = """
local out, i = {}, 0
for key in string.gmatch(ARGV[1], '([^\\n]*)\\n') do
  i = i + 1
  key = KEYS[1] .. key
  if redis.call('SET', key, ARGV[2], 'NX', 'PX', ARGV[4]) then
    out[i] = 'c'
  elseif redis.call('GET', key) == ARGV[3] then
    out[i] = 'd'
  else
    out[i] = 'b'
  end
end
return table.concat(out)
"""

# SET ... GET (Redis >= 6.2) writes done and returns what it replaced, to count takeovers in one call.
_CONFIRM_LUA = """
local taken_over = 0
for key in string.gmatch(ARGV[1], '([^\\n]*)\\n') do
  local old = redis.call('SET', KEYS[1] .. key, ARGV[3], 'PX', ARGV[4], 'GET')
  if old and old ~= ARGV[2] and old ~= ARGV[3] then
    taken_over = taken_over + 1
  end
end
return taken_over
"""

_RELEASE_LUA = """
local released = 0
for key in string.gmatch(ARGV[1], '([^\\n]*)\\n') do
  key = KEYS[1] .. key
  if redis.call('GET', key) == ARGV[2] then
    redis.call('DEL', key)
    released = released + 1
  end
end
return released
"""


def _joined(batch: list[str]) -> str:
    """The batch as one newline-terminated string; refuses keys that contain a newline."""
    payload = "\n".join(batch) + "\n"
    if payload.count("\n") != len(batch):
        raise ValueError("dedup keys must not contain a newline character")
    return payload


# Errors a MULTI/EXEC reports for the application's own queued commands (a wrong type, a syntax error)
# reach the caller unchanged; these ResponseErrors describe the server itself, so they mean unavailable.
_SERVER_REFUSALS = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class RedisInbox:
    """One open inbox transaction: queue the effect's Redis writes on ``pipe``.

    ``pipe`` is a redis-py pipeline inside MULTI: commands queued on it return nothing until the block
    ends, then they and the confirmation of the inbox's keys run as one MULTI/EXEC. Do not call
    ``pipe.execute()`` yourself. ``already_done`` is True when every key was confirmed before the block
    began (an earlier attempt committed, or another consumer did): the queued writes are then discarded.
    """

    def __init__(self, pipe: Pipeline, *, already_done: bool) -> None:
        self.pipe = pipe
        self.already_done = already_done


def _reset(pipe: Pipeline) -> None:
    """Discard the pipeline's queued writes and WATCHes and give its connection back to the pool."""
    try:
        pipe.reset()
    except redis.RedisError as exc:
        # UNWATCH failed on a dead or hung connection: the WATCHes die with it. Raising here would hide
        # the error that ended the block.
        logger.debug("could not reset an inbox pipeline (%s); its connection is dropped", exc)


def _describe(client: redis.Redis) -> str:
    """Where the client points, without its password, for error messages."""
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    return f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


class RedisDedupStore(DedupStore):
    """A dedup store in Redis (>= 6.2): one key per message id, shared by any number of consumers.

    Decisions worth knowing:

    - ``confirm`` writes done unconditionally, even over another consumer's claim taken after our lease
      expired: the handler already ran, so done is the truth; such takeovers are logged as a warning.
    - Claims and confirmations live only as long as Redis keeps them. A Redis without persistence (or
      restored from an older snapshot) forgets confirmed keys on restart, and redelivered messages then
      run again: duplicates are caught only within what the store remembers. Use AOF persistence
      (``appendonly yes``) for the strongest memory.
    - Every key carries a TTL, so any eviction policy other than ``noeviction`` may drop claims and
      confirmations under memory pressure; the store warns at start when it can read the policy.
    - A batch is one script call; the script builds the keys from the prefix it is routed by, so on Redis
      Cluster (not tested here) put a hash tag in the prefix (``prefix="rk:dedup:{my-group}:"``) to keep
      every key in the prefix's slot.
    - Keys must not contain a newline (the batch travels as one newline-separated argument).
    - A client built from a URL retries a failed connection once at once (a restarted server closes
      pooled connections) and never retries a timeout. Retrying a claim whose reply was lost is safe:
      the key then reads busy until its lease expires, it never runs twice.
    - Inbox mode (``inbox(keys)``) makes an effect stored in the same Redis exactly-once: the
      application's writes and the confirmation of ``keys`` are one MULTI/EXEC, guarded by WATCH so that
      an inbox whose keys are already done writes nothing (see ``inbox``).
    """

    def __init__(
        self,
        url_or_client: str | redis.Redis,
        *,
        prefix: str = "rk:dedup:",
        retention_s: float = DEFAULT_RETENTION_S,
        socket_timeout_s: float = 2.0,
    ) -> None:
        """Connect to Redis and check it answers; a client passed in stays the caller's to close.

        ``retention_s``: how long a confirmed key is remembered. ``socket_timeout_s``: the longest a call
        waits for Redis before raising ``DedupStoreUnavailable``. It applies to a client built from a URL;
        a client passed in keeps its own timeouts and retries (redis-py's default retries for seconds).
        """
        self.owner = uuid.uuid4().hex
        self.prefix = prefix
        self._retention_ms = retention_ms(retention_s)
        self._claim_value = f"claim:{self.owner}"
        self._owns_client = isinstance(url_or_client, str)
        if isinstance(url_or_client, str):
            self._client: redis.Redis = redis.Redis.from_url(
                url_or_client,
                socket_timeout=socket_timeout_s,
                socket_connect_timeout=socket_timeout_s,
                retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            )
        else:
            self._client = url_or_client
        self.where = _describe(self._client)
        self._claim = self._client.register_script(_CLAIM_LUA)
        self._confirm = self._client.register_script(_CONFIRM_LUA)
        self._release = self._client.register_script(_RELEASE_LUA)
        self._warn_if_evicting()

    def _unavailable(self, action: str, exc: BaseException) -> DedupStoreUnavailable:
        return DedupStoreUnavailable(
            f"Redis dedup store at {self.where} could not {action}:"
            f" {type(exc).__name__}: {str(exc).rstrip('.')}. The consumer holds its progress (fail-closed)"
            " until Redis answers again: check that redis-server is running, reachable and not out of memory."
        )

    def _run(self, action: str, script: Any, batch: list[str], *args: str | int) -> Any:
        try:
            return script(keys=[self.prefix], args=[_joined(batch), self._claim_value, _DONE, *args])
        except redis.RedisError as exc:
            raise self._unavailable(action, exc) from exc

    def _warn_if_evicting(self) -> None:
        try:
            policy = self._client.config_get("maxmemory-policy").get("maxmemory-policy")
        except redis.ResponseError:
            # Managed Redis services often disable CONFIG; the docstring carries the advice instead.
            logger.debug("cannot read maxmemory-policy of %s; not checking the eviction policy", self.where)
            return
        except redis.RedisError as exc:
            raise self._unavailable("connect", exc) from exc
        if isinstance(policy, bytes):
            policy = policy.decode()
        if policy is not None and policy != "noeviction":
            logger.warning(
                "Redis at %s has maxmemory-policy=%s: under memory pressure it may evict dedup keys and"
                " let duplicates through; set maxmemory-policy noeviction",
                self.where,
                policy,
            )

    def claim(self, keys: Sequence[str], lease_s: float = 30.0) -> ClaimResult:
        """Reserve every free or expired key for ``lease_s``; one script call for the batch."""
        lease = lease_ms(lease_s)
        batch = distinct_keys(keys)
        if not batch:
            return ClaimResult(frozenset(), frozenset(), frozenset())
        reply = self._run("claim keys", self._claim, batch, lease)
        answers = reply.decode() if isinstance(reply, bytes) else str(reply)
        if len(answers) != len(batch):
            raise self._unavailable(
                "claim keys", ValueError(f"script answered {len(answers)} keys for a batch of {len(batch)}")
            )
        by_answer: dict[str, list[str]] = {"c": [], "d": [], "b": []}
        for key, answer in zip(batch, answers, strict=True):
            by_answer[answer].append(key)
        return ClaimResult(
            claimed=frozenset(by_answer["c"]), done=frozenset(by_answer["d"]), busy=frozenset(by_answer["b"])
        )

    def confirm(self, keys: Sequence[str]) -> None:
        """Record the keys as done for ``retention_s``, whatever their claim state (see the class notes)."""
        batch = distinct_keys(keys)
        if not batch:
            return
        taken_over = self._run("confirm keys", self._confirm, batch, self._retention_ms)
        if taken_over:
            logger.warning(
                "confirmed %d key(s) that another consumer had claimed after this one's lease expired;"
                " the handler may have run twice: raise lease_s above the longest handler time",
                taken_over,
            )

    def release(self, keys: Sequence[str]) -> None:
        """Delete this store's claims on the keys; done keys and other owners' claims stay."""
        batch = distinct_keys(keys)
        if not batch:
            return
        self._run("release keys", self._release, batch)

    @contextmanager
    def inbox(self, keys: Sequence[str]) -> Iterator[RedisInbox]:
        """A Redis transaction holding the application's writes and the confirmation of ``keys``.

        ::

            with store.inbox([key]) as tx:
                tx.pipe.hincrby("stock", item, -1)

        When the block ends normally the queued writes and ``done`` for every key are applied by one
        MULTI/EXEC: both or neither, and a process killed before that leaves neither (the claim then
        expires and the message runs again). An exception in the block discards the queued writes and
        is re-raised unchanged.

        The keys are WATCHed before the block runs. If every key is already done, the transaction is
        an earlier attempt that committed (its reply lost to a timeout, say) or another consumer's that
        took the key over: the block's writes are discarded and ``tx.already_done`` is True, so
        retrying an inbox never applies its effect twice. A key that changes between the check and
        EXEC aborts the transaction (nothing is written) with ``DedupStoreUnavailable``: retry.
        Redis does not roll back a queued command that fails at run time (a wrong type): the others,
        the confirmation included, are still applied and the command's ``ResponseError`` is raised, so
        queue only commands that cannot fail that way. Two to three round trips per inbox.
        """
        batch = distinct_keys(keys)
        names = [self.prefix + key for key in batch]
        pipe = self._client.pipeline(transaction=True)
        try:
            try:
                values: list[Any] = []
                if names:
                    pipe.watch(*names)
                    values = pipe.mget(names)
                pipe.multi()
            except redis.RedisError as exc:
                raise self._unavailable("open an inbox transaction", exc) from exc
            states = [_text(value) for value in values]
            done = states.count(_DONE)
            taken_over = sum(1 for state in states if state not in (None, _DONE, self._claim_value))
            tx = RedisInbox(pipe, already_done=bool(batch) and done == len(batch))
            yield tx
            if tx.already_done:
                logger.debug("inbox keys %s were already done; their writes are discarded", batch[:5])
                return
            for name in names:
                pipe.set(name, _DONE, px=self._retention_ms)
            try:
                pipe.execute()
            except redis.WatchError as exc:
                raise self._unavailable(
                    "commit an inbox transaction (a key changed after it was checked, so nothing was"
                    " written; retry)",
                    exc,
                ) from exc
            except redis.ResponseError as exc:
                if isinstance(exc, _SERVER_REFUSALS):
                    raise self._unavailable("commit an inbox transaction", exc) from exc
                raise
            except redis.RedisError as exc:
                raise self._unavailable("commit an inbox transaction", exc) from exc
            if done or taken_over:
                logger.warning(
                    "inbox confirmed %d key(s) already done and %d claimed by another consumer after this"
                    " one's lease expired; their effect may be applied twice: raise lease_s above the longest"
                    " handler time and keep the keys of one effect together",
                    done,
                    taken_over,
                )
        finally:
            _reset(pipe)

    def close(self) -> None:
        """Close the connection pool if this store created the client; a caller's client stays open."""
        if self._owns_client:
            self._client.close()
