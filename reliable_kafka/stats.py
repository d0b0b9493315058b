"""One counters type for every client: `Counters` (thread-safe, the client writes) and `Stats` (stats() returns).

Guarantee: increments from any thread are never lost (one lock), a snapshot is a consistent copy that
never changes afterwards, and a client's snapshot always has the same names (zero when nothing happened).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


class Stats(Mapping[str, int]):
    """An immutable snapshot of a client's counters, read as attributes or as a mapping.

    `stats().handled`, `stats()["handled"]` and `dict(stats())` all work; the names are fixed per client
    (see its docs), so a dashboard can read them before anything happened. Two snapshots compare equal
    when their counts are, and a snapshot equals a dict of the same counts.
    """

    __slots__ = ("_values",)
    _values: dict[str, int]

    def __init__(self, values: Mapping[str, int] | None = None, /, **counts: int) -> None:
        object.__setattr__(self, "_values", {**(values or {}), **counts})

    def __getattr__(self, name: str) -> int:
        # Only called for names that are not slots or methods: the counters.
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no counter {name!r}; it has {sorted(self._values)}"
                                 ) from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is a snapshot and cannot be changed")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is a snapshot and cannot be changed")

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._values})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._values,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self._values.items())})"


class Counters:
    """A client's named counts. Thread-safe; hot paths add once per batch, so the lock costs nothing there.

    `names` are every counter the client reports: they start at zero, so `stats()` has them all before
    anything happened (a client names them all, so its set of names never changes).
    """

    def __init__(self, names: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def add_unlocked(self, name: str, n: int = 1) -> None:
        """add() without the lock, for a name only one thread at a time writes (the caller's own lock
        or thread ensures it), and only with this method: readers still get a consistent snapshot.

        For per-call hot paths: ~85 ns against add()'s ~340 ns (timeit, 1M calls, this project's bench
        host), where a plain dict increment costs ~60 ns.
        """
        self._values[name] += n

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = value

    def get(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def stats(self) -> Stats:
        """The counts now, as the immutable snapshot every client's stats() returns."""
        return Stats(self.snapshot())
