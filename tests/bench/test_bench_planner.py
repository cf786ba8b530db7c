"""Smoke test of `python -m varuna.bench planner --json --quick`, and its statistics.

Benchmarks never gate: nothing here asserts an error's size or a correlation's value, only that the
report is complete and its figures are what their definitions say.
"""

from __future__ import annotations

import math
import statistics

import pytest
from _helpers import run_bench

from varuna.bench import split_half_gap
from varuna.bench.planner import PlannerBench, quick, spearman, summarize
from varuna.errors import ConfigError

KEYS = {"pipeline", "data", "micro_batch_size", "schedule", "predicted_s", "measured_s", "error"}


def test_spearman_and_the_summary() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)  # ties share a rank
    assert math.isnan(spearman([1, 1], [1, 2]))
    configs = [
        {
            "pipeline": 1,
            "data": 2,
            "micro_batch_size": 2,
            "schedule": "1f1b",
            "predicted_s": 1.0,
            "measured_s": 1.25,
        },
        {
            "pipeline": 2,
            "data": 1,
            "micro_batch_size": 2,
            "schedule": "1f1b",
            "predicted_s": 1.05,
            "measured_s": 1.0,
        },
        {
            "pipeline": 4,
            "data": 1,
            "micro_batch_size": 2,
            "schedule": "1f1b",
            "predicted_s": 2.0,
            "measured_s": 2.0,
        },
    ]
    s = summarize(configs)
    assert s["mean_abs_error"] == pytest.approx((0.2 + 0.05 + 0.0) / 3)
    assert s["max_abs_error"] == pytest.approx(0.2)
    assert s["spearman"] == pytest.approx(0.5)
    # the predicted best (1x2) measured 1.25 s against the measured best's 1.0 s
    assert s["best_gap"] == pytest.approx(0.25)
    assert (s["predicted_best"], s["measured_best"]) == ("1x2 mbs 2 1f1b", "2x1 mbs 2 1f1b")
    assert s["split_half_gap_mean"] is None and s["split_half_gap_max"] is None  # no steps given
    gapped = summarize([c | {"split_half_gap": g} for c, g in zip(configs, (0.01, 0.09, 0.02))])
    assert gapped["split_half_gap_mean"] == pytest.approx(0.04) and gapped["split_half_gap_max"] == 0.09
    assert s["mean_error_by_shape"] == pytest.approx({"1x2": -0.2, "2x1": 0.05, "4x1": 0.0})
    assert s["targets_met"] == {
        "mean_abs_error": True,
        "max_abs_error": True,
        "spearman": False,
        "best_gap": False,
    }
    # the network issue's stricter targets: a mean of 8.3% misses 5%, a max of 20% misses 10%
    assert s["strict_targets_met"] == {
        "mean_abs_error": False,
        "max_abs_error": False,
        "spearman": False,
        "best_gap": False,
    }
    close = summarize([c | {"predicted_s": c["measured_s"] * f} for c, f in zip(configs, (1.04, 0.98, 1.0))])
    assert close["strict_targets_met"] == dict.fromkeys(close["strict_targets_met"], True)


def test_the_split_half_gap_compares_the_medians_of_alternate_steps() -> None:
    assert split_half_gap([1.0, 2.0, 1.0, 2.0]) == pytest.approx(1.0)  # odd steps 1 s, even 2 s
    assert split_half_gap([1.0, 1.0, 2.0, 2.0]) == 0.0  # a change over time falls on both halves
    assert split_half_gap([1.0, 1.2, 1.1, 1.3, 1.0]) == pytest.approx(0.25)  # medians 1.0 and 1.25
    assert split_half_gap([1.0]) is None


def test_the_full_preset_covers_what_the_issue_asks() -> None:
    from varuna.bench.planner import full

    configs = full().configs()
    assert len(configs) >= 6
    assert {(P, D) for P, D, _, _ in configs} == {(1, 2), (2, 1), (2, 2), (4, 1)}
    assert len({m for _, _, m, _ in configs}) == 2 and len({s for _, _, _, s in configs}) == 2
    # at 1x2 the two schedules run the same actions: measured once per micro-batch size, as 1F1B
    assert sorted((m, s) for P, _, m, s in configs if P == 1) == [(2, "1f1b"), (4, "1f1b")]
    assert len(configs) == 14 and len(set(configs)) == 14


def test_bad_settings_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"shapes holds 3x1; P x D must be 2 or 4"):
        PlannerBench(shapes=((3, 1),))
    with pytest.raises(
        ConfigError, match=r"global_batch_size 6 is not divisible by D x micro_batch_size = 2 x 4"
    ):
        PlannerBench(global_batch_size=6, micro_batch_sizes=(4,))
    with pytest.raises(ConfigError, match=r"PlannerBench.rounds must be a positive integer \(got 0\)"):
        PlannerBench(rounds=0)


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_planner_bench_quick_reports_every_configuration() -> None:
    report, stderr = run_bench("planner", timeout=170)
    for key in (
        "mean_abs_error",
        "max_abs_error",
        "spearman",
        "best_gap",
        "targets",
        "targets_met",
        "strict_targets",
        "strict_targets_met",
        "profile",
    ):
        assert key in report, key
    configs = report["configs"]
    assert len(configs) == len(quick().configs())
    for c in configs:
        assert KEYS <= set(c)
        assert c["predicted_s"] > 0 and c["measured_s"] > 0
        assert c["error"] == pytest.approx(c["predicted_s"] / c["measured_s"] - 1)
        assert c["rounds"] and all(r["step_s"] for r in c["rounds"])
        assert c["predicted_s_round_profile"] > 0
        # its own resolution: the medians of the alternate timed steps of the rounds measured_s is over
        clean = [r for r in c["rounds"] if r["clean"] and r["profile_clean"]] or c["rounds"]
        steps = [t for r in clean for t in r["step_s"]]
        a, b = statistics.median(steps[0::2]), statistics.median(steps[1::2])
        assert c["split_half_gap"] == pytest.approx(abs(a - b) / min(a, b))
    # every prediction uses the compute profiled around its configuration, not the round's
    rounds = [r for c in configs for r in c["rounds"]]
    assert any(r["predicted_s"] != r["predicted_s_round_profile"] for r in rounds)
    assert report["max_abs_error"] == pytest.approx(max(abs(c["error"]) for c in configs))
    assert set(report["profile"]["compute_slowdown"]) == {"1", "2", "3", "4"}
    for record in (r for per_world in report["profile"]["per_round"].values() for r in per_world):
        assert record["delivery_s"] and all(t > 0 for _, t in record["message_cpu"])  # what each round used
        assert 0 <= record["action_overhead_s"] < 0.01
    assert "mean |error|" in stderr and "best gap" in stderr  # the table
    assert report["split_half_gap_max"] == pytest.approx(max(c["split_half_gap"] for c in configs))
    assert "the measurement's own resolution" in stderr
    assert set(report["mean_error_by_shape"]) == {"1x2", "2x1", "2x2"}
    assert "mean signed error by P x D: 1x2 " in stderr
