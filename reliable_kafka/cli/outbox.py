"""`reliable-kafka outbox`: look into a producer's outbox (or every slot of an outbox pool), and retry or
purge its failed messages.

status and list-failed open files read-only and take no lock (a running producer keeps its own);
retry-failed and purge need the producer stopped, because only one process may own an outbox.
"""

from __future__ import annotations

from pathlib import Path

import click

from reliable_kafka.cli.output import check_writable, emit_json, fail, table
from reliable_kafka.errors import OutboxError
from reliable_kafka.outbox import Outbox
from reliable_kafka.outbox.pool import pool_status

path_option = click.option("--path", "path", required=True, type=click.Path(dir_okay=False, path_type=Path),
                           help="The outbox file (the producer's outbox_path).")


def _open(path: Path, *, read_only: bool) -> Outbox:
    if not path.exists():
        fail(f"no outbox at {path}")
    try:
        return Outbox(path, read_only=read_only)
    except OutboxError as exc:
        fail(str(exc))
    raise AssertionError("unreachable")


@click.group("outbox")
def outbox_group() -> None:
    """Inspect and repair a ReliableProducer outbox file."""


@outbox_group.command("status")
@click.option("--path", "path", type=click.Path(dir_okay=False, path_type=Path),
              help="The outbox file (the producer's outbox_path).")
@click.option("--dir", "directory", type=click.Path(file_okay=False, path_type=Path),
              help="An outbox pool (the producers' outbox_dir): one line per slot.")
# `--json` alone (as before) or `--json -` print JSON on stdout; `--json FILE` writes it there.
@click.option("--json", "json_path", is_flag=False, flag_value="-", default=None, metavar="[PATH]",
              help="JSON instead of the table, on stdout ('-', the default) or to PATH.")
def status(path: Path | None, directory: Path | None, json_path: str | None) -> None:
    """Pending and failed counts, the age of the oldest pending message, the file size; with --dir, for
    every slot of the pool, with the pid that owns it."""
    if (path is None) == (directory is None):
        fail("give --path FILE (one outbox) or --dir DIR (an outbox pool)", code=2)
    check_writable(json_path)
    if directory is not None:
        _pool_status(directory, json_path)
        return
    assert path is not None
    with _open(path, read_only=True) as ob:
        s = ob.stats()
    data = {"path": str(path), "pending": s.pending, "failed": s.failed,
            "oldest_pending_age_s": s.oldest_pending_age_s, "file_bytes": s.file_bytes}
    if json_path is not None:
        emit_json(data, json_path)
    else:
        table(f"outbox {path}", ["pending", "failed", "oldest pending (s)", "file bytes"],
              [[s.pending, s.failed, _age(s.oldest_pending_age_s), s.file_bytes]])


def _age(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.1f}"


def _pool_status(directory: Path, json_path: str | None) -> None:
    try:
        slots = pool_status(directory)
    except OutboxError as exc:
        fail(str(exc))
        return
    if json_path is not None:
        emit_json({"dir": str(directory), "slots": [s.as_json() for s in slots]}, json_path)
        return
    table(f"outbox pool {directory} ({len(slots)} slot(s))",
          ["slot", "owner pid", "pending", "failed", "oldest pending (s)", "file bytes", "problem"],
          [[s.path.name, s.owner_pid if s.locked else "", s.pending, s.failed, _age(s.oldest_pending_age_s),
            s.file_bytes, s.problem] for s in slots])


@outbox_group.command("list-failed")
@path_option
@click.option("--limit", type=int, default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def list_failed(path: Path, limit: int, as_json: bool) -> None:
    """Messages Kafka refused for good, with the broker's reason."""
    with _open(path, read_only=True) as ob:
        rows = ob.failed(limit)
    if as_json:
        emit_json({"failed": [{"seq": r.seq, "message_id": r.message_id, "topic": r.topic,
                               "bytes": len(r.value or b""), "attempts": r.attempts, "reason": r.last_error}
                              for r in rows]})
        return
    table(f"failed messages in {path}", ["seq", "message id", "topic", "bytes", "attempts", "reason"],
          [[r.seq, r.message_id, r.topic, len(r.value or b""), r.attempts, r.last_error] for r in rows])


@outbox_group.command("retry-failed")
@path_option
@click.option("--seq", "seqs", type=int, multiple=True, help="Only these (default: all failed).")
def retry_failed(path: Path, seqs: tuple[int, ...]) -> None:
    """Move failed messages back to pending; the producer sends them on its next start."""
    with _open(path, read_only=False) as ob:
        n = ob.retry_failed(list(seqs) or None)
    click.echo(f"{n} message(s) back to pending")


@outbox_group.command("purge")
@path_option
@click.option("--seq", "seqs", type=int, multiple=True, help="Only these (default: all failed).")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def purge(path: Path, seqs: tuple[int, ...], yes: bool) -> None:
    """Delete failed messages for good (pending messages are never purged from here)."""
    if not yes:
        click.confirm(f"delete {'these' if seqs else 'all'} failed messages from {path} for good?", abort=True)
    with _open(path, read_only=False) as ob:
        n = ob.purge(state="failed", seqs=list(seqs) or None)
    click.echo(f"{n} failed message(s) purged")
