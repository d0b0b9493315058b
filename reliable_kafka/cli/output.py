"""How every CLI command talks: JSON for machines, rich tables for people, errors on stderr.

Errors end the command with a one-line message and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

console = Console(stderr=False)
err_console = Console(stderr=True, soft_wrap=True)


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}")
    sys.exit(code)


def emit_json(data: Any, path: str | None = None) -> None:
    """Write JSON to stdout (path None or '-') or to a file; an unwritable path is a clear error."""
    text = json.dumps(data, indent=2, default=str)
    if path in (None, "-"):
        click.echo(text)
        return
    assert path is not None
    try:
        Path(path).write_text(text + "\n")
    except OSError as exc:
        fail(f"cannot write JSON to {path}: {exc.strerror or exc}")


def check_writable(path: str | None) -> None:
    """Refuse an unwritable output path before spending minutes on the work that fills it."""
    if path in (None, "-"):
        return
    assert path is not None
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        fail(f"cannot write to {path}: it is a directory")
    if not parent.is_dir():
        fail(f"cannot write to {path}: directory {parent} does not exist")
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        fail(f"cannot write to {path}: {exc.strerror or exc}")


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    console.print(t)
