"""Which optional extra installs which modules, and the error a part raises when its extra is missing.

`import reliable_kafka` needs none of the extras; a part that does (the CLI, RedisDedupStore, the Spark
connector) imports its modules on first use inside `needs_extra`, so a missing one is one clear line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from reliable_kafka.errors import MissingExtra

# Top-level module names each extra of pyproject.toml installs (the ones a part imports at start), the one
# the extra is for first: a message names that one ("needs pyspark"), not a dependency of it ("needs numpy").
EXTRAS: dict[str, tuple[str, ...]] = {
    "cli": ("click", "rich", "psutil"),
    "plot": ("matplotlib",),
    "redis": ("redis",),
    "services": ("fastapi", "uvicorn", "httpx"),
    "spark": ("pyspark", "pyarrow", "pandas", "numpy"),
}


@contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Turn a ModuleNotFoundError for one of `extra`'s modules into MissingExtra naming the pip command.

    Any other missing module passes unchanged: it is a broken install, not a missing extra.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in EXTRAS[extra]:
            raise
        raise MissingExtra(extra, what, missing) from exc


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` this install lacks (found without importing them), in EXTRAS' order."""
    return [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
