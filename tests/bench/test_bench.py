"""Smoke test of `python -m varuna.bench pipeline --json --quick`: it runs and reports every system.

Benchmarks never gate: nothing here asserts a timing or a ratio's value, only that they are there.
"""

from __future__ import annotations

import math

import pytest
from _helpers import run_bench

from varuna.schedule import schedule_spec

pytestmark = pytest.mark.multirank


@pytest.mark.timeout(240)
def test_pipeline_bench_quick_reports_every_system() -> None:
    report, _ = run_bench("pipeline", timeout=230)
    assert {"model", "results", "ratios"} <= set(report)
    for key in (
        "config",
        "params",
        "global_batch_size",
        "micro_batch_size",
        "threads_per_rank",
        "host_cores",
    ):
        assert key in report["model"]

    seen = {(r["system"], r["schedule"]) for r in report["results"]}
    assert ("single", None) in seen
    paired = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")
    unpaired = ("eager-1f1b", "varuna")  # schedules torch.pipelining lacks
    assert {("varuna", s) for s in (*paired, *unpaired)} <= seen
    assert {("torch.pipelining", s) for s in paired} <= seen
    for r in report["results"]:
        assert {"pipeline", "microbatches", "samples_per_s"} <= set(r)
        assert r["samples_per_s"] > 0 and math.isfinite(r["samples_per_s"])
        assert r["pipeline"] == (1 if r["system"] == "single" else r["pipeline"])
        if r["system"] != "single":  # every rank measured its step's peak memory (Linux)
            peaks = r["step_peak_bytes_per_stage"]
            assert len(peaks) == r["pipeline"] and all(isinstance(b, int) and b > 0 for b in peaks)
    # Same seed, same batch: every system's first loss is the same number (a correctness check, not a timing).
    assert report["model"]["first_loss_spread"] < 1e-4

    # One job ran every system: at each schedule both systems run, they alternated step by step,
    # each round giving one pair ratio, torch's 1F1B (the reference) ran in every schedule's rounds
    # and the baseline in 1F1B's.
    steps = report["model"]["paired_steps"]
    for r in report["results"]:
        if r["system"] == "single":
            assert r["paired_with"] == "1f1b" and len(r["step_s"]) == steps
            continue
        assert len(r["step_s"]) == steps
        # both systems of a schedule are cut at the same boundaries (Varuna's engine fitted them to
        # that schedule: partition="fastest")
        spec = schedule_spec(r["schedule"])
        assert len(r["boundaries"]) == spec.chunks_per_rank * r["pipeline"] - 1
        same = [
            o
            for o in report["results"]
            if o["system"] != "single" and o["pipeline"] == r["pipeline"] and o["schedule"] == r["schedule"]
        ]
        assert all(o["boundaries"] == r["boundaries"] for o in same)
        if r["schedule"] in unpaired:
            assert "pair_ratios" not in r
        else:
            assert r["paired"] and len(r["pair_ratios"]) == steps
        # a share of the ideal per round: beside the baseline (1F1B's rounds), else through torch's
        # 1F1B in the same rounds (the reference)
        assert len(r["of_ideal_per_round"]) == steps
        assert ("of_ideal_via" in r) == (r["schedule"] != "1f1b")
    ratios = report["ratios"]
    pipelines = sorted({r["pipeline"] for r in report["results"] if r["system"] != "single"})
    for P in pipelines:
        assert set(ratios["varuna_over_torch_pipelining"][f"P{P}"]) == set(paired)
        assert set(ratios["of_bubble_ideal"]["varuna"][f"P{P}"]) == {*paired, *unpaired}
        assert set(ratios["paired"]["varuna_over_torch_pipelining"][f"P{P}"]) == set(paired)
        assert f"P{P}" in ratios["oversubscribed"]
    goal = ratios["targets"]  # the targets, at the smallest P: named, not asserted
    assert goal["pipeline"] == pipelines[0] and goal["varuna_best"] in (*paired, *unpaired)
    assert goal["varuna_best_over_torch_1f1b"] > 0 and goal["worst_same_schedule"]["schedule"] in paired
    # torch's 1F1B ran in the rounds of every schedule at that P: each system over it step by step
    for r in report["results"]:
        if r["system"] != "single" and r["pipeline"] == pipelines[0]:
            assert len(r["ref_ratios"]) == steps and all(x > 0 for x in r["ref_ratios"])
            if (r["system"], r["schedule"]) == ("torch.pipelining", "1f1b"):
                assert r["ref_ratios"] == [1.0] * steps  # itself
    over = goal["over_torch_1f1b"]
    assert set(over["varuna"]) == {*paired, *unpaired} and set(over["torch.pipelining"]) == set(paired)
    assert goal["varuna_best_over_torch_1f1b"] == over["varuna"][goal["varuna_best"]]["median"]
    assert goal["unpaired"]["varuna_best"] in (*paired, *unpaired)
    # every rank's main-thread CPU seconds, and from them each schedule's ceiling at the smallest P
    for r in report["results"]:
        if r["system"] != "single":
            threads = r["thread_cpu_s_per_step_per_stage"]
            assert len(threads) == r["pipeline"] and all(t > 0 for t in threads)
    ceilings = ratios["ceilings"]
    assert ceilings["pipeline"] == pipelines[0] and set(ceilings["schedules"]) == {*paired, *unpaired}
    for r in report["results"]:  # each Varuna rank's first forward (the fill), and the tighter bound
        if r["system"] == "varuna":
            assert len(r["first_forward_s_per_stage"]) == r["pipeline"]
            assert all(f > 0 for f in r["first_forward_s_per_stage"])
    for c in ceilings["schedules"].values():
        assert 0 < c["over_torch_1f1b_balanced_with_fill"] < c["over_torch_1f1b_balanced"]
    # the untied bench GPT: torch.pipelining trains the same model (its own LM head)
    assert report["model"]["config"]["tie_embeddings"] is False
    assert "own LM head" in report["model"]["torch_pipelining_head"]


def test_the_baseline_joins_the_rounds_of_the_shared_schedules() -> None:
    from varuna.bench.pipeline.worker import with_single

    spec = {"single": True, "varuna_schedules": ["gpipe", "1f1b", "varuna"], "torch_schedules": ["1f1b"]}
    assert [s for s in ("gpipe", "1f1b", "varuna") if with_single(spec, s)] == ["1f1b"]
    spec["torch_schedules"] = []  # nothing shared: the first schedule's rounds only
    assert [s for s in ("gpipe", "1f1b", "varuna") if with_single(spec, s)] == ["gpipe"]
    spec["single"] = False
    assert not any(with_single(spec, s) for s in ("gpipe", "1f1b", "varuna"))
    # with torch's 1F1B in every round (the reference), in 1F1B's rounds only
    spec |= {"single": True, "reference": True, "torch_schedules": ["gpipe", "1f1b"]}
    assert [s for s in ("gpipe", "1f1b", "varuna") if with_single(spec, s)] == ["1f1b"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"varuna_schedules": ()}, "varuna_schedules is empty"),
        ({"pipelines": (2, 2)}, "names a P twice"),
        ({"pipelines": (9,)}, r"\[2, n_layer\] = \[2, 8\]"),
        ({"torch_schedules": ("zb",)}, "'zb' is not one of"),
        ({"global_batch_size": 30}, "multiple of micro_batch_size"),
        (
            {"varuna_schedules": ("1f1b",), "torch_schedules": ("1f1b", "gpipe")},
            "'gpipe' is not among varuna_schedules",
        ),
    ],
)
def test_bad_bench_settings_name_the_fix(change: dict, message: str) -> None:
    from dataclasses import replace

    from varuna.bench.pipeline import full
    from varuna.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        replace(full(), **change)


def test_ceilings_bound_each_schedule_by_its_busiest_and_mean_rank() -> None:
    from varuna.bench.pipeline import compute_ceilings

    def rec(system: str, schedule: str | None, step: float, threads: list[float]) -> dict:
        return {
            "system": system,
            "schedule": schedule,
            "pipeline": 2 if system != "single" else 1,
            "median_step_s": step,
            "cpu_s_per_step_per_stage": [t + 0.5 for t in threads],  # gloo's threads: not the bound
            "thread_cpu_s_per_step_per_stage": threads,
        }

    results = [
        rec("torch.pipelining", "1f1b", 1.2, [1.0, 1.1]),
        rec("varuna", "1f1b", 1.15, [1.0, 1.0]),
        rec("varuna", "zb-h1", 1.25, [0.9, 1.2]),
        rec("single", None, 2.0, [2.0]),
    ]
    results[2]["first_forward_s_per_stage"] = [0.1, 0.04]  # stage 1 waits for stage 0's first forward
    got = compute_ceilings(results)
    assert got["pipeline"] == 2 and got["torch_1f1b_step_s"] == 1.2
    assert got["schedules"]["1f1b"] == {
        "busiest_rank_thread_cpu_s": 1.0,
        "mean_rank_thread_cpu_s": 1.0,
        "measured_over_torch_1f1b": round(1.2 / 1.15, 4),
        "over_torch_1f1b_at_these_cuts": 1.2,
        "over_torch_1f1b_balanced": 1.2,
    }
    assert "over_torch_1f1b_balanced_with_fill" not in got["schedules"]["1f1b"]  # no forwards given
    assert got["schedules"]["zb-h1"]["over_torch_1f1b_balanced_with_fill"] == round(
        1.2 / ((0.9 + 1.2 + 0.1) / 2), 4
    )
    zb = got["schedules"]["zb-h1"]
    assert zb["over_torch_1f1b_at_these_cuts"] == 1.0 and zb["over_torch_1f1b_balanced"] == round(
        1.2 / 1.05, 4
    )
    assert compute_ceilings([r for r in results if r["system"] != "torch.pipelining"]) == {}


def test_share_of_ideal() -> None:
    from varuna.bench.pipeline.worker import share_of_ideal

    # one process takes 9 s for the batch; 2 stages, 8 micro-batches: ideal step 9 / 2 * 9 / 8 s
    assert share_of_ideal(9 / 2 * 9 / 8, 9.0, 2, 8) == pytest.approx(1.0)
    assert share_of_ideal(2 * 9 / 2 * 9 / 8, 9.0, 2, 8) == pytest.approx(0.5)  # twice as slow
