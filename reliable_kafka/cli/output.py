"""How every CLI command talks: results (tables, JSON) on stdout, progress and errors on stderr.

Errors end the command with a one-line message and a non-zero exit code, never a traceback. When the
JSON goes to stdout (`--json -`), the table goes to stderr, so stdout parses. When stdout is not a
terminal, tables are plain aligned text with nothing cut, for logs and `grep`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

console = Console(stderr=True)  # progress and status lines: never mixed into what stdout carries
err_console = Console(stderr=True, soft_wrap=True)
out_console = Console()


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


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, to_stderr: bool = False,
          markup: bool = False) -> None:
    """Print a results table on stdout (on stderr with `to_stderr`, e.g. when stdout carries JSON).

    Cells are text, not rich markup (`pip install 'reliable-kafka[spark]'` keeps its `[spark]`), unless
    `markup` says the caller styled them.
    """
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    target = console if to_stderr else out_console
    if not target.is_terminal:
        plain = [[Text.from_markup(c).plain for c in r] for r in cells] if markup else cells
        target.file.write(plain_table(title, columns, plain))
        target.file.flush()
        return
    t = Table(title=title)
    for c in columns:
        t.add_column(c)
    for r in cells:
        t.add_row(*(r if markup else [escape(c) for c in r]))
    target.print(t)


def plain_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, two spaces apart: no truncation, whatever the width."""
    widths = [max([len(c), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip() + "\n"

    return title + "\n" + line(columns) + line(["-" * w for w in widths]) + "".join(line(r) for r in rows)
