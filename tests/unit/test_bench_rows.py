"""How `reliable-kafka bench` turns interleaved runs into a row: medians, per-round ratios, spreads, every
run kept, and a run too short to mean much said so."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from reliable_kafka.bench import suites
from reliable_kafka.bench.common import SHORT_RUN_S, BenchRow, peak_rss_mb, round_order, rows_against, run_facts


def _runs(*rates: float) -> list[dict[str, float]]:
    return [{"msgs_per_s": r, "peak_rss_mb": 100.0 + i} for i, r in enumerate(rates)]


def test_a_row_is_the_median_of_its_runs_and_the_ratio_the_median_of_per_round_ratios() -> None:
    # Round 2 hit a slow minute of the brokers: both variants ran slow in it.
    runs = {"raw": _runs(200_000, 100_000, 210_000), "ours": _runs(150_000, 90_000, 140_000)}
    base, ours = rows_against("producer", "raw", runs, 1_000_000)
    assert base.ratio_vs_baseline == 1.0 and base.msgs_per_s == 200_000
    assert ours.msgs_per_s == 140_000  # the median, not the best (150,000)
    assert ours.runs == (150_000, 90_000, 140_000)
    # per round: 0.75, 0.90, 0.667 -> median 0.75; the ratio of medians would be 0.70
    assert round(ours.ratio_vs_baseline, 3) == 0.75
    assert (round(ours.ratio_min or 0, 3), round(ours.ratio_max or 0, 3)) == (0.667, 0.9)
    assert ours.peak_rss_mb == 102.0


def test_every_run_is_in_the_json_and_a_row_reads_back_from_it() -> None:
    (row,) = rows_against("eos", "copier", {"copier": _runs(100_000, 120_000, 110_000)}, 1_000_000)
    data = row.as_json()
    assert data["runs"] == [100_000.0, 120_000.0, 110_000.0] and data["msgs_per_s"] == 110_000.0
    assert data["shortest_run_s"] == round(1_000_000 / 120_000, 2)
    assert BenchRow.from_json(data) == row
    # rows of an older JSON (no runs, no spread) still read
    old = {k: data[k] for k in ("name", "variant", "messages", "msgs_per_s", "baseline", "ratio_vs_baseline",
                                "peak_rss_mb")}
    assert BenchRow.from_json(old).runs == ()


def test_a_run_shorter_than_five_seconds_is_flagged() -> None:
    (fast,) = rows_against("consumer", "raw", {"raw": _runs(800_000, 900_000)}, 1_000_000)
    assert fast.short and fast.shortest_run_s < SHORT_RUN_S
    (slow,) = rows_against("producer", "raw", {"raw": _runs(150_000)}, 1_000_000)
    assert not slow.short


def test_rounds_alternate_their_order_so_each_variant_runs_first_and_last_alike(monkeypatch) -> None:
    assert [round_order("ABC", r) for r in range(4)] == [list("ABC"), list("CBA"), list("ABC"), list("CBA")]
    # The suites' rounds follow it, and round i of every variant is still measured in round i.
    ran: list[str] = []

    def fake_run(bench: str, variant: str, args: Any, connection: Any) -> dict[str, float]:
        ran.append(variant)
        return {"msgs_per_s": float(len(ran)), "peak_rss_mb": 1.0}

    monkeypatch.setattr(suites, "run_variant", fake_run)
    runs = suites._interleaved("producer", ("raw", "ours"), list, {}, 3, lambda _: None)
    assert ran == ["raw", "ours", "ours", "raw", "raw", "ours"]
    assert runs == {"raw": [{"msgs_per_s": float(i), "peak_rss_mb": 1.0} for i in (1, 4, 5)],
                    "ours": [{"msgs_per_s": float(i), "peak_rss_mb": 1.0} for i in (2, 3, 6)]}


def test_the_json_says_what_the_machine_was_and_did() -> None:
    facts = run_facts(messages=1_000_000, repeat=3, nodes=3, load_before=(0.5, 0.4, 0.3), local_cluster=True)
    assert facts["rounds"] == 3 and facts["cluster_nodes"] == 3 and facts["host"]["cores"] >= 1
    assert "reversed" in facts["round_order"]
    assert len(facts["host"]["load_after"]) == 3 and facts["host"]["load_before"] == [0.5, 0.4, 0.3]
    assert facts["versions"]["librdkafka"] and facts["versions"]["kafka"]
    assert run_facts(messages=1, repeat=1, nodes=3, load_before=(0, 0, 0), local_cluster=False)["versions"]["kafka"] \
        is None


def _call_runs(rate: float, commits: int | None = None, stall_ms: float | None = None) -> dict[str, float]:
    run = {"msgs_per_s": rate, "peak_rss_mb": 100.0}
    if commits is not None:
        run["commits"] = commits
    if stall_ms is not None:
        run["loop_stall_max_ms"] = stall_ms
    return run


def test_producer_calls_rows_each_against_its_own_baseline_with_commits_and_loop_stalls() -> None:
    from reliable_kafka.bench import calls

    n = 1_000_000
    # Two rounds of every variant; ours carry their commit count, the asyncio ones their worst stall.
    runs = {v.name: [_call_runs(
        {"raw": 100_000.0, "reliable": 80_000.0}[v.client] * (1 + i),
        commits=None if v.client == "raw" else 20_000 * (1 + i),
        stall_ms=(3.0 + 10 * i) if v.asyncio else None) for i in range(2)] for v in calls.VARIANTS}
    rows = {r.variant: r for r in calls.rows(runs, n)}
    assert list(rows) == [v.name for v in calls.VARIANTS]
    assert {r.variant: r.baseline for r in rows.values()} == {v.name: v.baseline for v in calls.VARIANTS}
    ours = rows["send-threads-16-process"]
    assert ours.ratio_vs_baseline == 0.8 and ours.extra["ratios"] == [0.8, 0.8]
    assert ours.extra["commits"] == [20_000, 40_000] and ours.extra["msgs_per_commit"] == 37.5  # median of 50, 25
    assert "loop_stall_max_ms" not in ours.extra and "commits" not in rows["raw-threads-16"].extra
    aio = rows["aio-send-tasks-200-memory"]
    assert aio.baseline == "aio-raw-tasks-200" and aio.extra["loop_stall_runs_ms"] == [3.0, 13.0]
    assert aio.extra["loop_stall_max_ms"] == 13.0 and rows["aio-raw-tasks-200"].extra["loop_stall_max_ms"] == 13.0
    data = aio.as_json()
    assert data["msgs_per_commit"] == 37.5 and data["ratios"] == [0.8, 0.8] and "extra" not in data
    assert BenchRow.from_json(data) == aio


def test_rows_without_extras_keep_their_json_keys() -> None:
    (row,) = rows_against("producer", "raw", {"raw": _runs(150_000)}, 1_000_000)
    assert list(row.as_json()) == ["name", "variant", "messages", "msgs_per_s", "baseline", "ratio_vs_baseline",
                                   "peak_rss_mb", "runs", "ratio_min", "ratio_max", "shortest_run_s"]


def test_messages_split_evenly_over_senders() -> None:
    from reliable_kafka.bench.calls import shares

    assert shares(1_000_000, 16) == [62_500] * 16
    assert shares(50_003, 200)[:3] == [251, 251, 251] and sum(shares(50_003, 200)) == 50_003


def test_consumer_rows_pair_the_asyncio_consumers_and_carry_their_loop_stalls(monkeypatch: Any) -> None:
    from reliable_kafka.bench import suites

    rates = {"raw": 800_000.0, "reliable_consumer": 760_000.0, "raw_librdkafka_defaults": 130_000.0,
             "aio_raw": 400_000.0, "aio_reliable": 380_000.0}
    asked: list[tuple[str, str]] = []

    def fake_run_variant(bench: str, variant: str, args: Any, connection: Any, timeout: float = 1800
                         ) -> dict[str, Any]:
        asked.append((bench, variant))
        rounds = sum(1 for b, v in asked if (b, v) == (bench, variant))
        run: dict[str, Any] = {"msgs_per_s": rates.get(variant, 1.0), "peak_rss_mb": 100.0}
        if variant.startswith("aio_"):  # the worker's asyncio variants report their worst stall
            run["loop_stall_max_ms"] = {"aio_raw": 2.0, "aio_reliable": 4.0}[variant] * rounds
        return run

    monkeypatch.setattr(suites, "run_variant", fake_run_variant)
    rows = {r.variant: r for r in suites.consumer_bench({"bootstrap.servers": "b:9092"}, lambda _t, _p: None,
                                                        1_000_000, lambda _s: None, repeat=2)}
    # every variant in each round, each in a worker of its own, the asyncio pair after the sync ones
    assert asked[2:7] == [("consumer", v) for v in ("raw", "reliable_consumer", "raw_librdkafka_defaults",
                                                    "aio_raw", "aio_reliable")]
    assert {v: r.baseline for v, r in rows.items()} == {
        "raw": "raw", "reliable_consumer": "raw", "raw_librdkafka_defaults": "raw",
        "aio_raw": "aio_raw", "aio_reliable": "aio_raw"}
    ours = rows["aio_reliable"]
    assert ours.ratio_vs_baseline == 0.95 and ours.extra == {"loop_stall_runs_ms": [4.0, 8.0],
                                                             "loop_stall_max_ms": 8.0}
    assert rows["aio_raw"].extra["loop_stall_max_ms"] == 4.0 and ours.runs == (380_000.0, 380_000.0)
    data = ours.as_json()
    assert data["loop_stall_max_ms"] == 8.0 and BenchRow.from_json(data) == ours
    # the sync rows' JSON is as before: no stall keys
    assert rows["reliable_consumer"].ratio_vs_baseline == 0.95 and rows["reliable_consumer"].extra == {}
    assert list(rows["reliable_consumer"].as_json()) == list(rows_against(
        "consumer", "raw", {"raw": _runs(1.0)}, 1)[0].as_json())


def test_dedup_rows_judge_each_store_against_its_hand_written_baseline_and_keep_the_rows_without_dedup(
        monkeypatch: Any) -> None:
    from reliable_kafka.bench import suites
    from reliable_kafka.bench.common import target_of

    rates = {"none": 600_000.0, "handwritten_sqlite": 100_000.0, "sqlite": 90_000.0,
             "handwritten_redis": 50_000.0, "redis": 30_000.0}
    asked: list[tuple[str, str]] = []

    def fake_run_variant(bench: str, variant: str, args: Any, connection: Any, timeout: float = 1800
                         ) -> dict[str, Any]:
        asked.append((bench, variant))
        # Round 2 (after the fill, the warm-up and round 1's five runs) is a slow minute of the brokers.
        return {"msgs_per_s": rates.get(variant, 1.0) / (2 if len(asked) > 7 else 1), "peak_rss_mb": 100.0}

    monkeypatch.setattr(suites, "run_variant", fake_run_variant)
    rows = suites.dedup_bench({"bootstrap.servers": "b:9092"}, lambda _t, _p: None, 1_000_000, lambda _s: None,
                              repeat=2, redis_url="redis://127.0.0.1:1/0")
    # fill, warm-up, then each round: none, and each hand-written baseline beside the store it judges (right
    # before it in round 1, right after it in round 2, whose order is reversed)
    order = ("none", "handwritten_sqlite", "sqlite", "handwritten_redis", "redis")
    assert asked == [("producer", "fill"), ("dedup", "none"), *[("dedup", v) for v in order + order[::-1]]]
    assert [(r.variant, r.baseline) for r in rows] == [
        ("none", "none"), ("sqlite", "none"), ("redis", "none"),
        ("handwritten_sqlite", "handwritten_sqlite"), ("sqlite", "handwritten_sqlite"),
        ("handwritten_redis", "handwritten_redis"), ("redis", "handwritten_redis")]
    by = {(r.variant, r.baseline): r for r in rows}
    assert by[("sqlite", "handwritten_sqlite")].ratio_vs_baseline == 0.9
    assert by[("redis", "handwritten_redis")].ratio_vs_baseline == 0.6
    assert by[("sqlite", "none")].ratio_vs_baseline == 0.15 and by[("sqlite", "none")].runs == (90_000.0, 45_000.0)
    # the target is met or missed against the hand-written baseline only; the rows against `none` are references
    assert {k: target_of(r) for k, r in by.items()} == {
        ("none", "none"): None, ("sqlite", "none"): None, ("redis", "none"): None,
        ("handwritten_sqlite", "handwritten_sqlite"): None, ("sqlite", "handwritten_sqlite"): 0.8,
        ("handwritten_redis", "handwritten_redis"): None, ("redis", "handwritten_redis"): 0.8}


def test_a_target_belongs_to_its_variant_against_any_baseline_unless_one_is_named() -> None:
    from reliable_kafka.bench.common import target_of

    (_, ours) = rows_against("consumer", "raw", {"raw": _runs(1.0), "reliable_consumer": _runs(1.0)}, 1)
    assert target_of(ours) == 0.9


def test_producer_rows_meet_their_targets_against_the_hand_written_safe_producer_and_keep_the_bare_loop_rows(
        monkeypatch: Any) -> None:
    from reliable_kafka.bench import suites
    from reliable_kafka.bench.common import target_of

    rates = {"raw": 200_000.0, "raw_safe": 150_000.0, "memory": 120_000.0, "process": 90_000.0, "fsync": 75_000.0}
    asked: list[tuple[str, str]] = []

    def fake_run_variant(bench: str, variant: str, args: Any, connection: Any, timeout: float = 1800
                         ) -> dict[str, Any]:
        asked.append((bench, variant))
        return {"msgs_per_s": rates[variant], "peak_rss_mb": 100.0}

    monkeypatch.setattr(suites, "run_variant", fake_run_variant)
    rows = suites.producer_bench({"bootstrap.servers": "b:9092"}, lambda _t, _p: None, 1_000_000, lambda _s: None,
                                 repeat=2)
    # a warm-up, then each round every variant in turn (round 2 in reverse), the safe producer beside the bare loop
    assert asked == [("producer", "raw"), *[("producer", v) for v in suites.PRODUCERS + suites.PRODUCERS[::-1]]]
    by = {(r.variant, r.baseline): r for r in rows}
    assert by[("memory", "raw_safe")].ratio_vs_baseline == 0.8 and by[("memory", "raw")].ratio_vs_baseline == 0.6
    assert abs(by[("raw", "raw_safe")].ratio_vs_baseline - 200_000 / 150_000) < 1e-9  # what header + callback cost
    # the targets (DESIGN.md §6) are judged against raw_safe only; the bare loop's rows are for continuity
    assert {k: target_of(r) for k, r in by.items() if target_of(r) is not None} == {
        ("memory", "raw_safe"): 0.95, ("process", "raw_safe"): 0.8, ("fsync", "raw_safe"): 0.6}
    assert ("raw_safe", "raw") not in by


def test_a_measured_childs_peak_memory_is_its_own_not_its_parents() -> None:
    """Linux carries a parent's ru_maxrss over exec(): bench eos's children reported the ~560 MB of the
    process that had seeded the input. peak_rss_mb() reads the child's own high-water mark."""
    ballast = b"x" * (400 << 20)  # written, so resident: the parent's peak is at least 400 MB
    try:
        parent = peak_rss_mb()
        out = subprocess.run([sys.executable, "-c", "from reliable_kafka.bench.common import peak_rss_mb; "
                              "print(peak_rss_mb())"], capture_output=True, text=True, check=True, timeout=60)
    finally:
        del ballast
    child = float(out.stdout)
    assert parent >= 400, parent
    assert 0 < child < 200, f"the child reported {child:.0f} MB, its parent {parent:.0f} MB"
