"""Smoke test of `python -m varuna.bench checkpoint --json --quick`: every mode runs and is reported.

Benchmarks never gate: nothing here asserts a timing or a ratio's value, only that they are there.
"""

from __future__ import annotations

import math

import pytest
from _helpers import run_bench

from varuna.bench.checkpoint import MODES, CheckpointBench, quick
from varuna.errors import ConfigError

pytestmark = pytest.mark.foreground


def _positive(value: object) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


@pytest.mark.timeout(120)
def test_checkpoint_bench_quick_reports_every_mode() -> None:
    report, stderr = run_bench("checkpoint", timeout=110)
    bench = quick()
    assert report["bench"] == "checkpoint" and report["settings"]["steps"] == bench.steps
    assert (
        _positive(report["params"]) and _positive(report["checkpoint_bytes"]) and _positive(report["seconds"])
    )
    assert set(report["modes"]) == set(MODES)
    for mode in MODES:
        m = report["modes"][mode]
        assert len(m["step_s"]) == bench.rounds and all(_positive(t) for t in m["step_s"]), (mode, m)
        assert _positive(m["step_s_mean"]), (mode, m)
    per_segment = bench.steps // bench.checkpoint_every
    for mode, keys in {
        "background": ("checkpoint_step_s", "other_step_s", "call_s", "copy_s", "write_s"),
        "blocking": ("checkpoint_step_s", "other_step_s", "call_s", "write_s"),
    }.items():
        m = report["modes"][mode]
        for key in keys:
            assert _positive(m[key]), (mode, key, m[key])
        # every checkpoint asked for was committed (the bench fails on a missing record)
        assert m["checkpoints"] == bench.rounds * per_segment
        overhead = m["overhead"]
        assert isinstance(overhead, float) and math.isfinite(overhead)
    ratio = report["background_over_blocking"]
    assert ratio is None or (isinstance(ratio, float) and math.isfinite(ratio))
    assert "checkpoint: round 1/1" in stderr


def test_checkpoint_bench_config_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"CheckpointBench.rounds must be a positive integer \(got 0\)"):
        CheckpointBench(rounds=0)
    with pytest.raises(
        ConfigError, match=r"CheckpointBench.warmup must be an integer in \[0, steps\) = \[0, 40\) \(got 40\)"
    ):
        CheckpointBench(warmup=40)
    with pytest.raises(
        ConfigError,
        match=r"CheckpointBench.checkpoint_every must be in \[2, steps - warmup\] = \[2, 5\] \(got 6\)",
    ):
        CheckpointBench(steps=10, warmup=5, checkpoint_every=6)
    with pytest.raises(
        ConfigError,
        match=r"CheckpointBench.checkpoint_every must be in \[2, steps - warmup\] = \[2, 35\] \(got 1\)",
    ):
        CheckpointBench(checkpoint_every=1)
    with pytest.raises(
        ConfigError,
        match=r"CheckpointBench.global_batch_size \(8\) must be a multiple of micro_batch_size \(3\)",
    ):
        CheckpointBench(micro_batch_size=3)
    with pytest.raises(ConfigError, match=r"CheckpointBench.lr must be a positive number \(got 0\)"):
        CheckpointBench(lr=0)
    with pytest.raises(
        ConfigError, match=r"CheckpointBench.model: .*'d_modle'.*GPTConfig's fields are vocab_size"
    ):
        CheckpointBench(model={"d_modle": 32})
    with pytest.raises(
        ConfigError, match=r"CheckpointBench.model: GPTConfig.d_model must be divisible by n_head"
    ):
        CheckpointBench(model={"d_model": 30, "n_head": 4})
