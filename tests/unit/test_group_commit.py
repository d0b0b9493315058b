"""GroupCommit against a fake accept(): concurrent submissions share commits, each caller gets its own
outcome, a lone caller commits inline, leadership is handed on, async tickets are woken once per commit;
and the asyncio front end's event loop keeps running while a commit is slow. No Kafka."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from reliable_kafka import AsyncReliableProducer, OutboxFull
from reliable_kafka.producer import group_commit
from reliable_kafka.producer.dispatcher import Dispatcher
from reliable_kafka.producer.group_commit import GroupCommit, Ticket
from reliable_kafka.spool import NewMessage
from reliable_kafka.testing.loop_stall import LoopStallProbe

NOWHERE = {"bootstrap.servers": "127.0.0.1:1"}


def row(name: str) -> NewMessage:
    return NewMessage(name, "t", name.encode())


class FakeAccept:
    """Records each call (its rows and the thread that made it) and numbers rows like a spool."""

    def __init__(self, delay_s: float = 0.0, poison: str | None = None) -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.seq_of: dict[str, int] = {}
        self._seqs = itertools.count(1)
        self._delay_s = delay_s
        self._poison = poison
        self.entered = threading.Event()  # set once the first call is inside
        self.gate = threading.Event()  # the first call waits for it
        self.gate.set()
        self.holds: dict[int, threading.Event] = {}  # call number (from 1) -> released when set

    def __call__(self, rows: Sequence[NewMessage], errors: dict[int, str]) -> list[int]:
        names = [r.message_id for r in rows]
        self.calls.append((names, threading.current_thread().name))
        self.entered.set()
        self.gate.wait(10)
        hold = self.holds.get(len(self.calls))
        if hold is not None:
            assert hold.wait(10)
        time.sleep(self._delay_s)
        if self._poison is not None and self._poison in names:
            raise OutboxFull("fake: the outbox stayed full")
        seqs = [next(self._seqs) for _ in rows]
        self.seq_of.update(zip(names, seqs, strict=True))
        for name, seq in zip(names, seqs, strict=True):
            if name.startswith("refused"):
                errors[seq] = "fake refusal"
        return seqs


def wait_for(predicate, what: str, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_concurrent_submissions_share_commits_and_each_caller_gets_its_own_seq() -> None:
    accept = FakeAccept(delay_s=0.002)
    group = GroupCommit(accept)
    got: dict[str, tuple[int, str | None]] = {}
    start = threading.Barrier(16)

    def caller(t: int) -> None:
        start.wait()
        for i in range(40):
            name = f"refused-{t}-{i}" if i == 7 else f"m-{t}-{i}"
            got[name] = group.submit(row(name))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    sizes = [len(names) for names, _ in accept.calls]
    assert sum(sizes) == len(got) == 16 * 40
    assert len(sizes) < len(got), f"no commit carried more than one message: {sizes}"
    # Each caller got the seq its own row was stored under, and only its own refusal.
    assert all(seq == accept.seq_of[name] for name, (seq, _) in got.items())
    assert {name for name, (_, error) in got.items() if error} == {f"refused-{t}-7" for t in range(16)}
    assert all(error == "fake refusal" for name, (_, error) in got.items() if name.startswith("refused"))


def test_a_single_caller_commits_inline_on_its_own_thread() -> None:
    accept = FakeAccept()
    group = GroupCommit(accept)
    before = threading.active_count()
    seqs = [group.submit(row(f"m-{i}"))[0] for i in range(100)]
    assert seqs == list(range(1, 101))
    assert [len(names) for names, _ in accept.calls] == [1] * 100
    assert {thread for _, thread in accept.calls} == {threading.current_thread().name}
    assert threading.active_count() == before, "a sync-only caller started a thread"


def _queue_behind_a_held_commit(group: GroupCommit, accept: FakeAccept, names: list[str]
                                ) -> tuple[dict[str, object], list[threading.Thread]]:
    """Hold the first commit (by 'first') in accept() while `names` queue behind it, each on its own thread."""
    outcome: dict[str, object] = {}

    def caller(name: str) -> None:
        try:
            outcome[name] = group.submit(row(name))
        except Exception as exc:  # noqa: BLE001 - recorded for the assertions
            outcome[name] = exc

    accept.gate.clear()
    threads = [threading.Thread(target=caller, args=("first",))]
    threads[0].start()
    assert accept.entered.wait(10)
    for name in names:
        threads.append(threading.Thread(target=caller, args=(name,)))
        threads[-1].start()
    wait_for(lambda: group.queued == len(names), "the callers to queue")
    accept.gate.set()
    for th in threads:
        th.join(30)
    return outcome, threads


def test_an_exception_in_accept_reaches_every_ticket_of_its_batch_and_none_of_another() -> None:
    accept = FakeAccept(poison="poison")
    group = GroupCommit(accept)
    outcome, _ = _queue_behind_a_held_commit(group, accept, ["a", "poison", "b"])
    assert [sorted(names) for names, _ in accept.calls] == [["first"], ["a", "b", "poison"]]
    assert outcome["first"] == (accept.seq_of["first"], None)
    for name in ("a", "poison", "b"):
        assert isinstance(outcome[name], OutboxFull), outcome[name]
    # The next commit is not affected.
    assert group.submit(row("after")) == (accept.seq_of["after"], None)


def test_a_leader_commits_the_batch_holding_its_own_ticket_and_hands_on() -> None:
    """Under sustained load from 8 threads, every commit holds a message of the thread that ran it:
    no thread keeps leading for others."""
    accept = FakeAccept(delay_s=0.001)
    group = GroupCommit(accept)

    def caller(t: int) -> None:
        for i in range(30):
            group.submit(row(f"{threading.current_thread().name}/{i}"))

    threads = [threading.Thread(target=caller, args=(t,), name=f"caller-{t}") for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sum(len(names) for names, _ in accept.calls) == 240
    for names, thread in accept.calls:
        assert any(n.startswith(f"{thread}/") for n in names), f"{thread} committed only others' messages: {names}"
    assert len(accept.calls) < 240


def test_a_leader_that_committed_its_own_message_leaves_the_next_batch_to_its_owner() -> None:
    """'first' commits alone (held); A queues and leads the next commit (held); B queues meanwhile. When
    A's commit is done, A returns: B's message is committed by B's thread, not by A's."""
    accept = FakeAccept()
    group = GroupCommit(accept)
    held = {1: threading.Event(), 2: threading.Event()}
    accept.holds.update(held)
    threads = {name: threading.Thread(target=group.submit, args=(row(name),), name=name) for name in "FAB"}
    threads["F"].start()
    wait_for(lambda: len(accept.calls) == 1, "F's commit")
    threads["A"].start()
    wait_for(lambda: group.queued == 1, "A to queue")
    held[1].set()
    wait_for(lambda: len(accept.calls) == 2, "A's commit")
    threads["B"].start()
    wait_for(lambda: group.queued == 1, "B to queue")
    held[2].set()
    for th in threads.values():
        th.join(10)
    assert accept.calls == [(["F"], "F"), (["A"], "A"), (["B"], "B")]


def _commit_three_behind_a_held_one(group: GroupCommit, accept: FakeAccept, held_s: float) -> None:
    """'first' commits alone while A, B and C queue; their commit (the second) lasts `held_s`; all return."""
    hold = accept.holds[2] = threading.Event()
    threading.Timer(held_s, hold.set).start()  # how long the commit of A, B and C takes
    _queue_behind_a_held_commit(group, accept, ["A", "B", "C"])
    assert [sorted(names) for names, _ in accept.calls] == [["first"], ["A", "B", "C"]]


def test_the_first_caller_back_after_a_commit_waits_for_the_others_and_commits_with_them() -> None:
    """The three callers a commit settled are expected back: the first submission after it (D) does not
    commit alone but waits, and the next two (E, F) join its commit. From 16 threads in "fsync", the
    first caller back had committed alone while the others queued: every other fsync carried one message."""
    accept = FakeAccept()
    group = GroupCommit(accept)
    _commit_three_behind_a_held_one(group, accept, held_s=0.05)
    # The window is as long as that commit took; made long here, so that no slow host closes it early.
    group._gather_until = time.monotonic() + 60.0
    threads = {name: threading.Thread(target=group.submit, args=(row(name),), name=name) for name in "DEF"}
    threads["D"].start()
    wait_for(lambda: group.queued == 1, "D to wait for company")
    assert len(accept.calls) == 2, "D committed alone"
    threads["E"].start()
    wait_for(lambda: group.queued == 2, "E to queue behind D")
    threads["F"].start()  # the third one back: D commits now
    for th in threads.values():
        th.join(10)
    assert accept.calls[2:] == [(["D", "E", "F"], "D")]


def test_a_caller_back_alone_waits_no_longer_than_the_last_commit_took() -> None:
    """Callers that do not come back are not waited for: a lone caller after a 0.3 s commit of three is
    committed alone once those 0.3 s have passed since that commit ended, and the next lone caller at once."""
    accept = FakeAccept()
    group = GroupCommit(accept)
    _commit_three_behind_a_held_one(group, accept, held_s=0.3)
    took = time.monotonic()
    assert group.submit(row("D")) == (accept.seq_of["D"], None)
    took = time.monotonic() - took
    assert accept.calls[2:] == [(["D"], threading.current_thread().name)]
    assert took < 0.3 + 5.0, f"D waited {took:.1f} s"  # bounded, with room for a slow host
    assert group.submit(row("E")) == (accept.seq_of["E"], None)  # D settled itself: expected back, and is
    assert accept.calls[3:] == [(["E"], threading.current_thread().name)]


def test_a_combined_batch_is_bounded() -> None:
    accept = FakeAccept()
    group = GroupCommit(accept, max_batch=2)
    names = [f"m-{i}" for i in range(5)]
    outcome, _ = _queue_behind_a_held_commit(group, accept, names)
    assert all(len(n) <= 2 for n, _ in accept.calls), accept.calls
    assert all(outcome[name] == (accept.seq_of[name], None) for name in names)


def test_async_tickets_are_committed_by_the_writer_and_woken_once_per_waker_per_commit() -> None:
    accept = FakeAccept()
    group = GroupCommit(accept, name="gc-writer")
    woken: dict[str, list[list[str]]] = {"a": [], "b": []}
    all_done = threading.Event()

    def waker(label: str):  # type: ignore[no-untyped-def]
        def wake(tickets: list[Ticket]) -> None:
            woken[label].append([t.row.message_id for t in tickets])
            if sum(len(x) for x in woken["a"] + woken["b"]) == 16:
                all_done.set()
        return wake

    wake_a, wake_b = waker("a"), waker("b")
    accept.gate.clear()
    first = group.submit_async(row("a-first"), wake_a, None)
    assert accept.entered.wait(10)  # the writer holds the first commit
    tickets = [group.submit_async(row(f"a-{i}"), wake_a, None) for i in range(10)]
    tickets += [group.submit_async(row(f"b-{i}"), wake_b, None) for i in range(5)]
    accept.gate.set()
    assert all_done.wait(10)
    assert [len(names) for names, _ in accept.calls] == [1, 15]
    assert {thread for _, thread in accept.calls} == {"gc-writer"}
    assert woken["a"] == [["a-first"], [f"a-{i}" for i in range(10)]]
    assert woken["b"] == [[f"b-{i}" for i in range(5)]]
    assert all(t.done and t.seq == accept.seq_of[t.row.message_id] for t in [first, *tickets])
    group.close(5)
    with pytest.raises(Exception, match="after close"):
        group.submit(row("late"))


def test_a_slow_commit_does_not_stall_the_event_loop(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every outbox commit takes 0.3 s; 50 concurrent send() calls on the asyncio front end still leave
    the loop free: a probe task that sleeps 10 ms is never late by more than a fraction of a commit."""
    real_accept = Dispatcher.accept

    def slow_accept(self: Dispatcher, rows: Sequence[NewMessage], errors: dict[int, str]) -> list[int]:
        time.sleep(0.3)
        return real_accept(self, rows, errors)

    monkeypatch.setattr(Dispatcher, "accept", slow_accept)

    async def main() -> tuple[float, int, int]:
        async with AsyncReliableProducer(NOWHERE, outbox_path=tmp_path / "o.db", preflight="off") as p:
            with LoopStallProbe(0.01, discount_cpu_waits=True) as probe:
                sent = await asyncio.gather(*(p.send("t", f"v-{i}".encode()) for i in range(50)))
            commits = p.stats().commits
            await p.close(0.1)
        return probe.worst_s, len({s.seq for s in sent}), commits

    worst, distinct, commits = asyncio.run(main())
    assert distinct == 50
    assert commits < 50
    # A commit on the loop would stall it by >= 0.3 s; a loaded 2-core host adds scheduling noise.
    assert worst < 0.15, f"the loop stalled {worst:.3f}s"


def test_a_caller_interrupted_while_waiting_takes_its_message_back_and_the_rest_go_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while send() waits behind another commit: that message is not stored, send() raises
    KeyboardInterrupt, and the callers queued with it are committed as usual. (The interruption is raised
    by the caller's own gate, where a KeyboardInterrupt lands in a real send(): a signal would reach the
    process's main thread, which under pytest-xdist is not the one running the test.)"""
    accept = FakeAccept()
    group = GroupCommit(accept)
    accept.gate.clear()
    outcome: dict[str, object] = {}

    def caller(name: str) -> None:
        outcome[name] = group.submit(row(name))

    first = threading.Thread(target=caller, args=("first",))
    first.start()
    assert accept.entered.wait(10)
    behind = threading.Thread(target=caller, args=("behind",))
    behind.start()
    wait_for(lambda: group.queued == 1, "'behind' to queue")

    class InterruptedGate:
        """A gate whose wait (its second acquire) is interrupted: what Ctrl-C does to a waiting send()."""

        def __init__(self) -> None:
            self._lock = threading.Lock()
            self.acquires = 0

        def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
            self.acquires += 1
            if self.acquires == 2:
                raise KeyboardInterrupt
            return self._lock.acquire(blocking, timeout)

        def release(self) -> None:
            self._lock.release()

    monkeypatch.setattr(group_commit, "threading", SimpleNamespace(Lock=InterruptedGate))
    with pytest.raises(KeyboardInterrupt):
        group.submit(row("interrupted"))
    monkeypatch.undo()
    assert group.queued == 1
    accept.gate.set()
    first.join(10)
    behind.join(10)
    assert [names for names, _ in accept.calls] == [["first"], ["behind"]]
    assert outcome == {"first": (accept.seq_of["first"], None), "behind": (accept.seq_of["behind"], None)}
    assert group.submit(row("after")) == (accept.seq_of["after"], None)
