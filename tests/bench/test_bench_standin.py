"""`python -m varuna.bench standin --quick`: the stand-in bench runs real jobs and reports every stage."""

from __future__ import annotations

import pytest
from _helpers import run_bench

from varuna.bench.standin import StandinBench
from varuna.errors import ConfigError


@pytest.mark.multirank
def test_standin_bench_quick_reports_every_stage() -> None:
    pytest.importorskip("transformers")
    report, stderr = run_bench("standin", timeout=240)
    stages = report["stages"]
    assert {(r["model"], r["stage"]) for r in stages} == {(m, s) for m in ("gpt2", "llama") for s in (0, 1)}
    for r in stages:
        assert r["forward_ms"] > 0 and 0 <= r["standin_ms"] < r["forward_ms"]
        # stage 0 runs nothing on stand-ins; stage 1 skips the embedding and the first blocks
        assert (r["standin_ms"] == 0) == (r["stage"] == 0)
    assert "max overhead" in stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"models": ("gpt2", "t5")}, r"models must name 'gpt2' and/or 'llama' \(got \['gpt2', 't5'\]\)"),
        ({"pipelines": (5,)}, r"pipelines must be integers >= 2 dividing blocks=12 \(got 5\)"),
        ({"repeats": 0}, r"StandinBench.repeats must be a positive integer \(got 0\)"),
    ],
)
def test_bad_standin_bench_settings_name_the_fix(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StandinBench(**change)
