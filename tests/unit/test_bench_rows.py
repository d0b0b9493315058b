"""How `reliable-kafka bench` turns interleaved runs into a row: medians, per-round ratios, spreads, every
run kept, and a run too short to mean much said so."""

from __future__ import annotations

from reliable_kafka.bench.common import SHORT_RUN_S, BenchRow, rows_against, run_facts


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


def test_the_json_says_what_the_machine_was_and_did() -> None:
    facts = run_facts(messages=1_000_000, repeat=3, nodes=3, load_before=(0.5, 0.4, 0.3), local_cluster=True)
    assert facts["rounds"] == 3 and facts["cluster_nodes"] == 3 and facts["host"]["cores"] >= 1
    assert len(facts["host"]["load_after"]) == 3 and facts["host"]["load_before"] == [0.5, 0.4, 0.3]
    assert facts["versions"]["librdkafka"] and facts["versions"]["kafka"]
    assert run_facts(messages=1, repeat=1, nodes=3, load_before=(0, 0, 0), local_cluster=False)["versions"]["kafka"] \
        is None
