"""The fault gates: a fault fires only when its condition holds, re-arms when it did not, and a feeder
keeps a source ahead until stopped."""

from __future__ import annotations

import itertools
import threading

import pytest

from reliable_kafka.testing.gates import FaultNotArmed, Feeder, fire_when, wait_drained, wait_for


def test_wait_for_returns_whether_the_condition_held() -> None:
    ticks = itertools.count()
    assert wait_for(lambda: next(ticks) >= 3, timeout_s=5, poll_s=0.001)
    assert not wait_for(lambda: False, timeout_s=0.05, poll_s=0.01)


def test_a_drain_waits_while_the_work_shrinks_and_stops_when_it_stalls() -> None:
    left = iter([50, 40, 30, 20, 10, 0])
    assert wait_drained(lambda: next(left), stall_s=1, timeout_s=5, poll_s=0.001) == 0
    # No progress for stall_s: what is left is returned, not waited for until timeout_s.
    stuck = iter([50, 40] + [40] * 10_000)
    assert wait_drained(lambda: next(stuck), stall_s=0.05, timeout_s=5, poll_s=0.001) == 40
    # Progress that never ends is still bounded by timeout_s.
    slow = itertools.count(10_000_000, -1)
    assert wait_drained(lambda: next(slow), stall_s=1, timeout_s=0.05, poll_s=0.001) > 0


def test_the_fault_fires_only_once_its_condition_holds() -> None:
    state = {"progress": 0, "fired_at": None}

    def ready() -> bool:
        state["progress"] += 1
        return state["progress"] >= 5

    def fire() -> str:
        state["fired_at"] = state["progress"]
        return "killed"

    assert fire_when(ready, fire, what="kill", timeout_s=5, poll_s=0.001) == "killed"
    assert state["fired_at"] == 5


def test_a_passed_window_is_re_armed_and_the_fault_still_lands() -> None:
    armed = threading.Event()
    rearms = []

    def rearm() -> None:
        rearms.append(1)
        armed.set()  # e.g. the input was topped up: the work is running again

    assert fire_when(armed.is_set, lambda: "fired", what="kill", rearm=rearm, attempts=3, timeout_s=0.05,
                     poll_s=0.01) == "fired"
    assert rearms == [1]


def test_a_condition_that_never_holds_fails_loudly_after_bounded_attempts() -> None:
    rearms = []
    with pytest.raises(FaultNotArmed, match="3 attempt"):
        fire_when(lambda: False, lambda: None, what="kill", rearm=lambda: rearms.append(1), attempts=3,
                  timeout_s=0.02, poll_s=0.005)
    assert len(rearms) == 2
    with pytest.raises(FaultNotArmed, match="1 attempt"):
        fire_when(lambda: False, lambda: None, what="kill", timeout_s=0.02, poll_s=0.005)


def test_the_feeder_tops_up_whenever_the_backlog_runs_low_and_stops_when_told() -> None:
    fed: list[int] = []
    consumed = {"n": 0}

    def backlog() -> int:
        consumed["n"] = min(consumed["n"] + 3, len(fed))  # a consumer eating 3 per tick
        return len(fed) - consumed["n"]

    with Feeder(lambda: fed.extend(range(10)), backlog, low=5, poll_s=0.001, max_top_ups=50) as feeder:
        assert wait_for(lambda: feeder.top_ups >= 5, timeout_s=5, poll_s=0.001)
    after = len(fed)
    assert after >= 50 and after % 10 == 0
    assert wait_for(lambda: False, timeout_s=0.02) is False and len(fed) == after  # stopped: no more top-ups


def test_the_feeder_is_bounded_and_a_failing_top_up_fails_the_caller() -> None:
    fed: list[int] = []
    feeder = Feeder(lambda: fed.append(1), lambda: 0, low=1, poll_s=0.0, max_top_ups=7).start()
    assert wait_for(lambda: len(fed) == 7, timeout_s=5, poll_s=0.001)
    feeder.stop()
    assert len(fed) == 7

    def broken() -> None:
        raise OSError("broker gone")

    feeder = Feeder(broken, lambda: 0, low=1, poll_s=0.0).start()
    with pytest.raises(RuntimeError, match="feeder failed"):
        assert wait_for(lambda: feeder.error is not None, timeout_s=5, poll_s=0.001)
        feeder.stop()


def test_a_look_at_kafka_that_times_out_is_asked_again_not_the_end_of_the_feeder() -> None:
    from confluent_kafka import KafkaError, KafkaException

    looks = [0]

    def backlog() -> int:
        looks[0] += 1
        if looks[0] == 1:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to get committed offsets"))
        return 0

    fed: list[int] = []
    feeder = Feeder(lambda: fed.append(1), backlog, low=1, poll_s=0.0, max_top_ups=3).start()
    assert wait_for(lambda: len(fed) == 3, timeout_s=5)
    feeder.stop()  # raises if the feeder died
    assert feeder.error is None and looks[0] >= 4

    def refused() -> int:
        raise KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))

    dead = Feeder(lambda: None, refused, low=1, poll_s=0.0).start()
    with pytest.raises(RuntimeError, match="the feeder failed"):
        assert wait_for(lambda: dead.error is not None, timeout_s=5)
        dead.stop()
