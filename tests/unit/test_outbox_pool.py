"""The outbox pool (outbox_dir=) without Kafka: slots claimed under real flocks by real processes, a
SIGKILLed owner's slot found again, adoption's choices, the status listing and a bad directory.

Nothing here shows a delivery: the producers below point at a closed port, so every row stays pending.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from reliable_kafka.cli.main import cli
from reliable_kafka.errors import ConfigError, OutboxLocked
from reliable_kafka.ids import new_id
from reliable_kafka.outbox import Outbox
from reliable_kafka.outbox.lock import owner
from reliable_kafka.outbox.pool import OutboxPool, pool_status, slot_path
from reliable_kafka.producer import ReliableProducer
from reliable_kafka.producer.adopter import SlotAdopter
from reliable_kafka.spool import Durability, NewMessage

pytestmark = pytest.mark.timeout(90)

REPO_ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = {"bootstrap.servers": "127.0.0.1:1"}

# A child that claims a slot of the pool in argv[1] once the file argv[2] exists (so that all children
# race for the same slots at once), spools argv[3] rows in it, says which slot it owns, and waits.
CLAIMER = """
    import os, sys, time
    from pathlib import Path
    from reliable_kafka.outbox.pool import OutboxPool
    from reliable_kafka.spool import Durability, NewMessage
    go = Path(sys.argv[2])
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    outbox = OutboxPool(sys.argv[1]).claim(durability=Durability.PROCESS, max_messages=1000)
    rows = [NewMessage(message_id=f"{os.getpid()}-{i}", topic="t", value=f"{os.getpid()}-{i}".encode())
            for i in range(int(sys.argv[3]))]
    outbox.append(rows)
    print(outbox.path.name, flush=True)
    sys.stdin.read()
"""


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)


def line_of(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # bounded by the module's timeout mark; a dead child gives ""
    assert line, f"child {proc.pid} exited without answering (exit {proc.poll()})"
    return line


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    """Child processes this test started; each is ended (stdin closed, then SIGKILL) if still running."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            try:
                proc.communicate(input="", timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def claim_in_children(children: list[subprocess.Popen[str]], directory: Path, n: int, rows: int) -> dict[int, str]:
    """Start `n` claimers racing for the pool's slots; returns {pid: slot file name}."""
    go = directory.parent / f"go-{len(children)}"
    procs = [spawn(CLAIMER, str(directory), str(go), str(rows)) for _ in range(n)]
    children.extend(procs)
    for proc in procs:
        assert line_of(proc) == "ready"
    go.touch()
    return {proc.pid: line_of(proc) for proc in procs}


def pending_rows(n: int) -> list[NewMessage]:
    return [NewMessage(message_id=new_id(), topic="t", value=f"row-{i}".encode()) for i in range(n)]


def claim(pool: OutboxPool) -> Outbox:
    return pool.claim(durability=Durability.PROCESS, max_messages=1000)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- claiming


def test_slots_are_claimed_lowest_free_first_and_freed_slots_are_reused(tmp_path: Path) -> None:
    pool = OutboxPool(tmp_path / "pool")
    (tmp_path / "pool" / "notes.db").write_bytes(b"not a slot")  # other files are not slots
    a, b, c = claim(pool), claim(pool), claim(pool)
    assert [x.path.name for x in (a, b, c)] == ["slot-0.db", "slot-1.db", "slot-2.db"]
    assert owner(b.path) == str(os.getpid())
    b.close()
    assert owner(b.path) is None
    again = claim(pool)
    assert again.path.name == "slot-1.db", "the lowest free slot is taken, not a new one"
    for x in (a, c, again):
        x.close()
    assert claim(pool).path.name == "slot-0.db"
    assert [s.path.name for s in pool_status(pool.directory)] == ["slot-0.db", "slot-1.db", "slot-2.db"]


def test_two_sets_of_real_processes_racing_for_slots_never_share_one(tmp_path: Path, children) -> None:
    directory = tmp_path / "pool"
    first = claim_in_children(children, directory, 4, rows=3)
    # A second wave races while the first still owns its slots: it must go around them.
    second = claim_in_children(children, directory, 4, rows=3)
    owned = {**first, **second}
    assert len(set(owned.values())) == 8, f"two live processes share a slot: {owned}"
    # Each process took the lowest slot it could lock, so the owned slots are exactly 0..7.
    assert set(owned.values()) == {f"slot-{i}.db" for i in range(8)}
    for pid, name in owned.items():
        assert owner(directory / name) == str(pid), "the lock file names the process that owns the slot"
    statuses = {s.path.name: s for s in pool_status(directory)}
    assert {name: (s.owner_pid, s.pending) for name, s in statuses.items()} == {
        name: (pid, 3) for pid, name in owned.items()}


# ----------------------------------------------------------------------------- a dead owner


def test_sigkilled_owner_leaves_its_slot_unlocked_and_pending_and_the_next_start_finds_it(tmp_path: Path,
                                                                                       children) -> None:
    directory = tmp_path / "pool"
    pool = OutboxPool(directory)
    own = claim(pool)  # slot-0: a live sibling, so the child gets slot-1
    [(pid, name)] = claim_in_children(children, directory, 1, rows=50).items()
    dead = directory / name
    assert name == "slot-1.db"
    assert pool.adoptable(own.path) == [], "a slot whose owner is alive is never adopted"
    os.kill(pid, signal.SIGKILL)  # the child started above, and only it
    assert children[0].wait(10) == -signal.SIGKILL
    [found] = pool.adoptable(own.path)
    assert (found.path, found.locked, found.pending) == (dead, False, 50)
    own.close()
    # A new process that starts now takes slot-0 (free) and adopts slot-1; one that finds slot-0 owned
    # claims slot-1 as its own, and its producer re-sends those 50 first.
    with Outbox(directory / "slot-0.db"):
        second = claim(OutboxPool(directory))
        assert (second.path, second.stats().pending) == (dead, 50)
        second.close()


def test_a_process_killed_while_adopting_releases_the_slot_for_the_next_adopter(tmp_path: Path, children) -> None:
    directory = tmp_path / "pool"
    directory.mkdir()
    with Outbox(directory / "slot-3.db") as orphan:
        orphan.append(pending_rows(7))
    adopter = spawn("""
        import sys
        from reliable_kafka.outbox import Outbox
        from reliable_kafka.outbox.pool import OutboxPool
        from reliable_kafka.spool import Durability
        pool = OutboxPool(sys.argv[1])
        own = pool.claim(durability=Durability.PROCESS, max_messages=1000)
        [slot] = pool.adoptable(own.path)
        adopted = Outbox(slot.path)  # what an adopter holds while it drains
        print(slot.path.name, slot.pending, flush=True)
        sys.stdin.read()
    """, str(directory))
    children.append(adopter)
    assert line_of(adopter) == "slot-3.db 7"
    assert owner(directory / "slot-3.db") == str(adopter.pid)
    os.kill(adopter.pid, signal.SIGKILL)
    assert adopter.wait(10) == -signal.SIGKILL
    with Outbox(directory / "slot-0.db") as own:  # the dead adopter's own slot is free again too
        [again] = OutboxPool(directory).adoptable(own.path)
    assert (again.path.name, again.locked, again.pending) == ("slot-3.db", False, 7)


# ----------------------------------------------------------------------------- adoption's choices


class StuckDrain:
    """A producer on one slot whose brokers never answer: it owns the slot and nothing leaves it."""

    def __init__(self, path: Path) -> None:
        self.outbox = Outbox(path)  # takes the slot's lock, or raises OutboxLocked
        self.started = False

    def start(self) -> object:
        self.started = True
        return self

    def flush(self, timeout: float | None = None) -> int:
        time.sleep(min(timeout or 0.0, 0.05))
        return self.outbox.stats().pending

    def close(self, timeout: float | None = 30.0) -> int:
        left = self.outbox.stats().pending
        self.outbox.close()
        return left


def test_adopter_takes_only_unowned_slots_with_pending_rows_and_holds_a_stuck_one_until_closed(tmp_path: Path,
                                                                                             children) -> None:
    directory = tmp_path / "pool"
    pool = OutboxPool(directory)
    own = claim(pool)                                            # slot-0: ours
    [(live_pid, live)] = claim_in_children(children, directory, 1, rows=5).items()  # slot-1: a live sibling
    with Outbox(directory / "slot-2.db"):                        # slot-2: empty and free
        pass
    with Outbox(directory / "slot-3.db") as orphan:              # slot-3: left pending by a dead process
        orphan.append(pending_rows(4))
    assert live == "slot-1.db"
    opened: list[Path] = []

    def open_slot(path: Path) -> StuckDrain:
        opened.append(path)
        return StuckDrain(path)

    adopter = SlotAdopter(pool, own.path, open_slot, rescan_s=0.05)
    adopter.start()
    try:
        wait_for(lambda: owner(directory / "slot-3.db") == str(os.getpid()), "the orphaned slot to be adopted")
        time.sleep(0.3)  # several rescans' worth: nothing else may be opened meanwhile
        assert opened == [directory / "slot-3.db"], "only the unowned slot with pending rows is adopted"
        assert owner(directory / "slot-1.db") == str(live_pid)
    finally:
        adopter.close()
    assert owner(directory / "slot-3.db") is None, "close() releases the adopted slot"
    assert pool_status(directory)[3].pending == 4, "what the drain did not deliver stays in the slot"
    own.close()


def test_adopter_skips_a_slot_another_process_took_first(tmp_path: Path) -> None:
    directory = tmp_path / "pool"
    pool = OutboxPool(directory)
    own = claim(pool)
    with Outbox(directory / "slot-1.db") as orphan:
        orphan.append(pending_rows(2))
    rival_won: list[Path] = []

    def open_slot(path: Path) -> StuckDrain:
        # Between the scan and the open another process locks the slot: the lock decides, we lose.
        rival_won.append(path)
        raise OutboxLocked(f"outbox {path} is owned by another producer (pid 1)")

    adopter = SlotAdopter(pool, own.path, open_slot, rescan_s=0.05)
    adopter.start()
    try:
        wait_for(lambda: len(rival_won) >= 2, "two scans that lose the race")
    finally:
        adopter.close()
    assert adopter.adopted == [], "a slot another process locked first is skipped, never shared"
    own.close()


def test_producer_adopts_a_dead_slot_without_blocking_send_and_close_releases_it(tmp_path: Path) -> None:
    directory = tmp_path / "pool"
    directory.mkdir()
    with Outbox(slot_path(directory, 1)) as orphan:
        orphan.append(pending_rows(20))
    p = ReliableProducer(UNREACHABLE, outbox_dir=directory, preflight="off")
    try:
        p.send("t", b"first")  # starts the producer and its adopter; pays the topic's deferred preflight
        wait_for(lambda: owner(directory / "slot-1.db") == str(os.getpid()), "slot-1 to be adopted")
        t0 = time.monotonic()
        p.send("t", b"accepted while adopting")  # the adopted slot's drain is stuck on the closed port
        assert time.monotonic() - t0 < 2, "send() does not wait for the adoption"
    finally:
        assert p.close(timeout=1) == 2
    assert owner(directory / "slot-1.db") is None and owner(directory / "slot-0.db") is None
    counts = {s.path.name: s.pending for s in pool_status(directory)}
    assert counts == {"slot-0.db": 2, "slot-1.db": 20}, "nothing is lost when the brokers never answered"


# ----------------------------------------------------------------------------- configuration


def test_outbox_dir_is_created_and_bad_combinations_are_config_errors(tmp_path: Path) -> None:
    made = tmp_path / "a" / "b"
    OutboxPool(made)
    assert made.is_dir()
    with pytest.raises(ConfigError, match="outbox_dir.*not both"):
        ReliableProducer(UNREACHABLE, outbox_dir=tmp_path / "d", outbox_path=tmp_path / "o.db")
    with pytest.raises(ConfigError, match="outbox_dir.*memory"):
        ReliableProducer(UNREACHABLE, outbox_dir=tmp_path / "d", durability="memory")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=rf"outbox_dir.*{blocker}.*choose another outbox_dir"):
        ReliableProducer(UNREACHABLE, outbox_dir=blocker / "pool")
    with pytest.raises(ConfigError, match=rf"{blocker} exists and is not a directory"):
        OutboxPool(blocker)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a read-only tmpfs (refused even to root), or a skip where mounting is not permitted."""
    mount_point = tmp_path / "ro"
    mount_point.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount_point)],
            capture_output=True, timeout=10).returncode != 0:
        pytest.skip("mounting a read-only tmpfs is not permitted here")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=10).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=10)


def test_an_unwritable_outbox_dir_is_a_config_error_that_names_it_and_the_fix(read_only_dir: Path) -> None:
    with pytest.raises(ConfigError, match=rf"{read_only_dir} is not writable.*choose another outbox_dir"):
        ReliableProducer(UNREACHABLE, outbox_dir=read_only_dir)
    with pytest.raises(ConfigError, match=rf"cannot create the outbox directory {read_only_dir / 'sub'}"):
        ReliableProducer(UNREACHABLE, outbox_dir=read_only_dir / "sub")


# ----------------------------------------------------------------------------- status


def test_status_lists_every_slot_with_owner_pending_failed_and_age(tmp_path: Path, children) -> None:
    directory = tmp_path / "pool"
    pool = OutboxPool(directory)
    [(live_pid, live)] = claim_in_children(children, directory, 1, rows=3).items()  # slot-0, owned
    with Outbox(directory / "slot-1.db") as orphan:
        seqs = orphan.append(pending_rows(5))
        orphan.mark_failed(seqs[0], "refused for good")
    (directory / "slot-2.db").touch()  # a slot whose creator died before it wrote anything
    runner = CliRunner()
    result = runner.invoke(cli, ["outbox", "status", "--dir", str(directory), "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    slots = {Path(s["path"]).name: s for s in data["slots"]}
    assert (slots[live]["locked"], slots[live]["owner_pid"], slots[live]["pending"]) == (True, live_pid, 3)
    assert (slots["slot-1.db"]["locked"], slots["slot-1.db"]["owner_pid"]) == (False, None)
    assert (slots["slot-1.db"]["pending"], slots["slot-1.db"]["failed"]) == (4, 1)
    assert slots["slot-1.db"]["oldest_pending_age_s"] is not None
    assert slots["slot-2.db"]["pending"] is None and "empty" in slots["slot-2.db"]["problem"]
    table = runner.invoke(cli, ["outbox", "status", "--dir", str(directory)])
    assert table.exit_code == 0 and str(live_pid) in table.stdout and "slot-2.db" in table.stdout
    assert pool.adoptable(directory / "slot-9.db")[0].path.name == "slot-1.db"
    missing = runner.invoke(cli, ["outbox", "status", "--dir", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "no outbox pool" in missing.output
    both = runner.invoke(cli, ["outbox", "status", "--dir", str(directory), "--path", str(directory / "x")])
    assert both.exit_code == 2
