"""Message ids and the header names reliable_kafka writes.

Every message gets a time-ordered unique id (UUIDv7 layout) in the `rk-id` header, so a re-send
after a crash carries the same id as its original and downstream dedup can recognise it.
"""

from __future__ import annotations

import os
import random
import threading
import time

ID_HEADER = "rk-id"

# Dead-letter headers: where the poison record came from and why it was parked.
DLQ_TOPIC = "rk-dlq-topic"
DLQ_PARTITION = "rk-dlq-partition"
DLQ_OFFSET = "rk-dlq-offset"
DLQ_TIMESTAMP = "rk-dlq-timestamp"
DLQ_ERROR_TYPE = "rk-dlq-error-type"
DLQ_ERROR = "rk-dlq-error"
DLQ_ATTEMPTS = "rk-dlq-attempts"

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_rng = random.Random()
# new_id()'s per-thread state: [fork generation, last ms, counter, prefix, random suffix].
_local = threading.local()
_fork_generation = 0


def _reseed_after_fork() -> None:
    # A forked child (Spark workers, multiprocessing) inherits the PRNG state: without a reseed two
    # processes would mint identical ids in the same millisecond, and dedup would drop real messages.
    # The generation makes the surviving thread draw new random bits for new_id() as well.
    global _last_ms, _counter, _fork_generation
    _rng.seed()
    _last_ms, _counter = 0, 0
    _fork_generation += 1


os.register_at_fork(after_in_child=_reseed_after_fork)


def new_id() -> str:
    """A UUIDv7-formatted id: 48-bit unix milliseconds, a 12-bit in-millisecond counter, 62 random bits.

    One send()'s id, made without new_ids()' process-wide lock: each thread keeps its own millisecond,
    counter and random bits (drawn on its first id, and again in a forked child), so the ids of one
    thread are strictly increasing and two threads' ids differ in their random bits, as two processes'
    do. Threads that send at once do not order their messages among themselves anyway (the outbox
    takes them in whatever order they arrive), so nothing is lost by not ordering their ids.

    Why not the lock: sixteen threads calling send() queued on it. A thread that holds it can be made
    to give up the GIL inside, and then every other sender blocks on the lock and sleeps, which cost
    16 threads minting ids half their throughput or more (measured: see CHANGELOG).
    """
    ms = time.time_ns() // 1_000_000
    state = getattr(_local, "state", None)
    if state is None or state[0] != _fork_generation:
        # This thread's first id: its own random bits, and it starts after every id made so far
        # (the lock once per thread: new_ids() may have made this thread's earlier ids).
        suffix = _random_suffix()
        with _lock:
            state = [_fork_generation, _last_ms, _counter, _prefix(_last_ms), suffix]
        _local.state = state
    if ms > state[1]:
        state[1], state[2], state[3] = ms, 0, _prefix(ms)
    elif state[2] < 0xFFF:
        state[2] += 1
    else:  # 4,096 ids in one millisecond: borrow the next one, as new_ids() does
        state[1] += 1
        state[2], state[3] = 0, _prefix(state[1])
    return state[3] + _COUNTER_HEX[state[2]] + state[4]


# The counter field as text, made once: formatting it per id was most of an id's cost.
_COUNTER_HEX = [f"{i:03x}" for i in range(0x1000)]


def _random_suffix() -> str:
    """The variant bits (0b10) and 62 random bits, as an id's last two fields."""
    # Uniqueness, not secrecy, is needed: the PRNG is several times cheaper than os.urandom.
    r = _rng.getrandbits(62)
    return f"-{0x8000 | (r >> 48):04x}-{r & 0xFFFFFFFFFFFF:012x}"


def _prefix(ms: int) -> str:
    """The time fields and the version nibble of every id made in millisecond `ms`."""
    return f"{ms >> 16:08x}-{ms & 0xFFFF:04x}-7"


def new_ids(n: int) -> list[str]:
    """`n` ids in increasing order at the cost of one clock read and one random draw (send_many's hot path).

    Within a process two ids never share (millisecond, counter); the random bits only have to tell
    processes apart, so one draw serves a whole call (RFC 9562 leaves how they are filled to us).
    More than 4096 ids in one millisecond borrow the next one, as the counter would overflow.
    """
    global _last_ms, _counter
    out: list[str] = []
    # The calling thread's new_id() state: this batch starts after its last id and new_id() goes on after
    # this batch, so one thread's ids stay increasing whichever of the two it calls.
    mine = getattr(_local, "state", None)
    if mine is not None and mine[0] != _fork_generation:
        mine = None
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms, _counter = ms, -1
        if mine is not None and (mine[1], mine[2]) > (_last_ms, _counter):
            _last_ms, _counter = mine[1], mine[2]
        suffix = _random_suffix()
        while n > 0:
            start = _counter + 1
            if start > 0xFFF:  # counter overflow: borrow the next millisecond
                _last_ms += 1
                start = 0
            take = min(n, 0x1000 - start)
            prefix = _prefix(_last_ms)
            out += [prefix + c + suffix for c in _COUNTER_HEX[start:start + take]]
            _counter = start + take - 1
            n -= take
        if mine is not None:
            mine[1], mine[2], mine[3] = _last_ms, _counter, _prefix(_last_ms)
    return out


def id_timestamp_ms(message_id: str) -> int:
    """The unix time in milliseconds at which an id was made."""
    return int(message_id.replace("-", "")[:12], 16)


def header_value(headers: list[tuple[str, bytes | None]] | dict[str, bytes] | None, name: str) -> bytes | None:
    """The last value of header `name`, from the list or dict confluent-kafka gives."""
    if not headers:
        return None
    if isinstance(headers, dict):
        return headers.get(name)
    found = None
    for key, value in headers:
        if key == name:
            found = value
    return found


def message_id_of(headers: list[tuple[str, bytes | None]] | dict[str, bytes] | None) -> str | None:
    """The rk-id of a consumed message, or None if a foreign producer wrote it."""
    raw = header_value(headers, ID_HEADER)
    return raw.decode() if raw is not None else None
