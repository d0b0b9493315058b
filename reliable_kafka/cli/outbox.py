"""`reliable-kafka outbox`: look into a producer's outbox, and retry or purge its failed messages.

status and list-failed open the file read-only (a running producer keeps its lock); retry-failed
and purge need the producer stopped, because only one process may own an outbox.
"""

from __future__ import annotations

from pathlib import Path

import click

from reliable_kafka.cli.output import emit_json, fail, table
from reliable_kafka.errors import OutboxError
from reliable_kafka.outbox import Outbox

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
@path_option
@click.option("--json", "as_json", is_flag=True)
def status(path: Path, as_json: bool) -> None:
    """Pending and failed counts, the age of the oldest pending message, the file size."""
    with _open(path, read_only=True) as ob:
        s = ob.stats()
    data = {"path": str(path), "pending": s.pending, "failed": s.failed,
            "oldest_pending_age_s": s.oldest_pending_age_s, "file_bytes": s.file_bytes}
    if as_json:
        emit_json(data)
    else:
        table(f"outbox {path}", ["pending", "failed", "oldest pending (s)", "file bytes"],
              [[s.pending, s.failed, "" if s.oldest_pending_age_s is None else f"{s.oldest_pending_age_s:.1f}",
                s.file_bytes]])


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
