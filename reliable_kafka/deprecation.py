"""The one way a client says a name of its API is going away: a DeprecationWarning naming the replacement.

Guarantee: a deprecated name keeps working for one release, and its warning points at the caller's line.
"""

from __future__ import annotations

import warnings


def warn_deprecated(old: str, new: str, *, stacklevel: int = 1) -> None:
    """Warn that `old` goes away in the next release and that `new` replaces it.

    `stacklevel` counts from the caller of this function, as for warnings.warn: 1 is that caller's line,
    2 its caller's, and so on; pick the user's line.
    """
    warnings.warn(f"{old} is deprecated and will be removed in the next release: {new} instead",
                  DeprecationWarning, stacklevel=stacklevel + 1)
