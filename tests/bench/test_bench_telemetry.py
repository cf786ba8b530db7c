"""`python -m varuna.bench telemetry`: the estimator on made-up steps, then a real `--quick --json` run.

Benchmarks never gate: nothing here asserts a measured timing or overhead, only that the report is
complete and sane. The estimator is checked on synthetic steps whose overhead is known exactly.
"""

from __future__ import annotations

import math

import pytest
from _helpers import run_bench

from varuna.bench.telemetry import TelemetryBench, analyse
from varuna.bench.telemetry.worker import phases
from varuna.errors import ConfigError

pytestmark = pytest.mark.foreground


def synthetic(pairs: int, extra: float, memory_extra: float, memory_every: int) -> list[dict]:
    """Steps of 1 s that drift slowly; "on" steps take `extra` longer, counting ones `memory_extra` more."""
    steps, recorded = [], 0
    for i, phase in enumerate(phases(2, pairs)):
        base = 1.0 + 0.3 * math.sin(i / 15)  # the host's load drifting over seconds
        counted = False
        if phase != "off":
            recorded += 1
            counted = recorded == 1 or recorded % memory_every == 0
        t = base * (1 + extra + (memory_extra if counted else 0.0)) if phase != "off" else base
        steps.append({"phase": phase, "wall_s": t, "cpu_s": [t / 2, t / 2], "memory_counted": counted})
    return steps


def test_phases_pair_adjacent_steps_in_alternating_order() -> None:
    assert phases(2, 4) == ["warmup", "warmup", "off", "on", "on", "off", "off", "on", "on", "off"]


def test_analyse_recovers_a_known_overhead_under_drift() -> None:
    steps = synthetic(80, extra=0.03, memory_extra=0.5, memory_every=10)
    got = analyse(steps, global_batch_size=8, memory_every=10, repeats=4)
    # a step 3 % longer, plus 50 % on 1 step in 10: ~8 % more time per on step
    expected = 1.0 - 1.0 / ((1.03 + 0.05) / 1.0)
    assert got["overhead"] == pytest.approx(expected, abs=0.01)
    assert got["cpu_overhead"] == pytest.approx(expected, abs=0.01)
    assert got["wall"]["typical_step_extra"] == pytest.approx(0.03, abs=0.005)
    assert got["wall"]["memory_count_pairs"] >= 6
    assert len(got["wall"]["per_repeat"]) == 4
    lo, hi = got["overhead_bootstrap_90"]
    assert lo <= got["overhead"] <= hi
    assert got["samples_per_s_on"] == pytest.approx(got["samples_per_s_off"] * (1 - got["overhead"]))


def test_analyse_sees_no_overhead_when_there_is_none() -> None:
    got = analyse(synthetic(40, 0.0, 0.0, 20), global_batch_size=8, memory_every=20)
    assert got["overhead"] == pytest.approx(0.0, abs=2e-3)  # the drift cancels (nearly) over pairs
    flat = [dict(s, wall_s=1.0, cpu_s=[0.5, 0.5]) for s in synthetic(40, 0.0, 0.0, 20)]
    assert analyse(flat, global_batch_size=8, memory_every=20)["overhead"] == pytest.approx(0.0, abs=1e-12)


def test_analyse_and_config_errors_teach_the_fix() -> None:
    with pytest.raises(ConfigError, match="raise TelemetryBench.pairs"):
        analyse(synthetic(0, 0.0, 0.0, 20), global_batch_size=8, memory_every=20)
    with pytest.raises(ConfigError, match=r"repeats \(9\) must be <= pairs \(4\)"):
        TelemetryBench(pairs=4, repeats=9)
    with pytest.raises(ConfigError, match="multiple of micro_batch_size"):
        TelemetryBench(global_batch_size=9, micro_batch_size=2)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_telemetry_bench_quick_reports_on_off_and_widget_refresh() -> None:
    report, _ = run_bench("telemetry", timeout=190)
    for key in ("samples_per_s_off", "samples_per_s_on"):
        assert isinstance(report[key], float) and report[key] > 0 and math.isfinite(report[key])
    assert isinstance(report["overhead"], float) and -1.0 < report["overhead"] < 1.0
    assert report["overhead"] == pytest.approx(
        (report["samples_per_s_off"] - report["samples_per_s_on"]) / report["samples_per_s_off"]
    )
    hz = report["widget_refresh_hz"]
    assert (isinstance(hz, float) and hz >= 0) or (hz is None and report["widget_refresh_note"])
    lo, hi = report["overhead_bootstrap_90"]
    assert lo <= hi
    assert isinstance(report["cpu_overhead"], float)

    model = report["model"]
    for key in (
        "config",
        "params",
        "pipeline",
        "schedule",
        "global_batch_size",
        "microbatches",
        "host_cores",
    ):
        assert key in model
    assert model["pipeline"] == 2 and model["params"] > 0

    # the real path: every rank's per-step metrics of the recording steps reached the controller
    steps = report["steps"]
    recorded = sum(s["phase"] != "off" for s in steps)
    assert report["controller"]["step_metrics_per_rank"] == [recorded] * model["pipeline"]
    assert report["controller"]["events_received_live"] > 0
    assert {s["phase"] for s in steps} == {"warmup", "off", "on"}
    assert any(s["memory_counted"] for s in steps if s["phase"] == "on")
    for s in steps:
        assert s["wall_s"] > 0 and len(s["cpu_s"]) == model["pipeline"]
    wall = report["estimate"]["wall"]
    assert len(wall["per_repeat"]) == report["method"]["repeats"]
    assert report["estimate"]["measured_steps"] == {
        "off": report["method"]["pairs"],
        "on": report["method"]["pairs"],
    }
