"""The one way a client says a name of its API is going away: a DeprecationWarning naming the replacement.

Guarantee: a deprecated name keeps working for one release, and its warning points at the caller's line.
"""

from __future__ import annotations

import warnings
from typing import TypeVar

from reliable_kafka.errors import ConfigError

T = TypeVar("T")


def warn_deprecated(old: str, new: str, *, stacklevel: int = 1) -> None:
    """Warn that `old` goes away in the next release and that `new` replaces it.

    `stacklevel` counts from the caller of this function, as for warnings.warn: 1 is that caller's line,
    2 its caller's, and so on; pick the user's line.
    """
    warnings.warn(f"{old} is deprecated and will be removed in the next release: {new} instead",
                  DeprecationWarning, stacklevel=stacklevel + 1)


def renamed(where: str, old: str, old_value: T | None, new: str, new_value: T, default: T) -> T:
    """The value of argument `new`, given that a caller may still pass its old name `old`.

    `old_value` is None when the old name was not passed. Both given with different values is a
    ConfigError: guessing which one the caller meant could change what a program does.
    """
    if old_value is None:
        return new_value
    if new_value is not default and new_value != old_value:
        raise ConfigError(old, f"pass only {new}= (the new name); both were given with different values")
    warn_deprecated(f"{where}({old}=...)", f"pass {new}=...", stacklevel=3)  # the line calling the constructor
    return old_value
