"""Where a long command's chatter goes: a log file of the run, so the terminal shows progress and verdicts.

`lab` and `bench` run many Kafka clients and a cluster. Their log lines (librdkafka's WARN/ERROR as
routed through `logging`, our own fault-gate re-arms) are for diagnosing a run, not for reading its
result, so at the default verbosity they go to `<runs dir>/<command>-<time>-<pid>/log.txt` and the
path is printed once. librdkafka clients made without a logger (the lab's bare control clients) and
child processes write `%3|...|FAIL|` lines straight to file descriptor 2, which `logging` cannot see:
so descriptor 2 itself points at the log file while the command runs, and `sys.stderr` (progress
bars, errors) at a copy of the original. `-v` leaves everything on stderr, as before.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def runs_dir() -> Path:
    """`$RK_RUNS_DIR`, else `~/.cache/reliable-kafka/runs` (beside the cluster state file)."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "reliable-kafka" / "runs"
    return Path(os.environ.get("RK_RUNS_DIR", base))


def _real_fd2() -> bool:
    # Under a test runner sys.stderr is a buffer, not descriptor 2: then only `logging` is redirected.
    try:
        return sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


def verbosity() -> int:
    """How many -v the `reliable-kafka` group was given (0 outside a command)."""
    ctx = click.get_current_context(silent=True)
    return int(ctx.find_root().params.get("verbose") or 0) if ctx is not None else 0


@contextmanager
def chatter_to_file(command: str, verbose: int | None = None) -> Iterator[Path | None]:
    """While the block runs, send log records and descriptor-2 output to the run's log file.

    Yields the log file's path, or None when -v was given (nothing is redirected then).
    """
    if (verbosity() if verbose is None else verbose) > 0:
        yield None
        return
    run_dir = runs_dir() / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "log.txt"
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_FORMAT))
    root.handlers = [file_handler]
    root.setLevel(logging.INFO)  # the file is for diagnosis: it gets what -v would show
    saved_fd, saved_stderr = None, sys.stderr
    if _real_fd2():
        sys.stderr.flush()
        saved_fd = os.dup(2)
        with open(path, "ab", buffering=0) as f:
            os.dup2(f.fileno(), 2)
        sys.stderr = os.fdopen(os.dup(saved_fd), "w", buffering=1, encoding="utf-8", errors="replace")
    sys.stderr.write(f"logs of this run (librdkafka, brokers, fault gates): {path}\n")
    try:
        yield path
    finally:
        root.handlers = handlers
        root.setLevel(level)
        file_handler.close()
        if saved_fd is not None:
            sys.stderr.flush()
            redirected = sys.stderr
            sys.stderr = saved_stderr
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            redirected.close()


__all__ = ["chatter_to_file", "runs_dir", "verbosity"]
