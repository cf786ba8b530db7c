"""Smoke test of `python -m varuna.bench morph --json --quick`: a real resize runs and is reported.

Benchmarks never gate: nothing here asserts a timing or a ratio's value, only that they are there.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from _helpers import run_bench

from varuna.bench.morph import MorphBench, driver, quick
from varuna.errors import ConfigError

pytestmark = pytest.mark.foreground

POSITIVE = (
    "params",
    "bytes",
    "write_s",
    "write_mb_s",
    "plain_write_mb_s",
    "plain_write_warm_mb_s",
    "write_fraction_of_plain",
    "relaunch_s",
    "load_s",
    "request_to_resumed_step_s",
)


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_morph_bench_quick_reports_a_resize() -> None:
    report, _ = run_bench("morph", timeout=230)
    for key in POSITIVE:
        value = report[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    assert (report["from_shape"], report["to_shape"]) == ("2x1", "1x2")
    assert set(report["definitions"]) >= {"relaunch_s", "load_s", "request_to_resumed_step_s"}
    assert set(report["targets"]) == {"request_to_resumed_step_s", "write_fraction_of_plain"}
    # the relaunched job resumed where the old one checkpointed, and trained on
    assert report["checkpoint_step"] >= quick().steps_before
    assert len(report["step_s"]["after"]) == quick().steps_after
    assert report["checkpoint_phases_s"]["dcp.save"] > 0 and report["load_phases_s"]["dcp.load"] > 0
    # the breakdown covers the whole request -> resumed step interval
    total = sum(report["breakdown_s"].values())
    assert total == pytest.approx(report["request_to_resumed_step_s"], abs=0.05)


def test_morph_bench_config_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"to_shape = 1x3: global_batch_size \(4\) must be a multiple"):
        MorphBench(to_shape=(1, 3))
    with pytest.raises(ConfigError, match=r"early_checkpoint_step \(2\) must be in \[0, steps_before\)"):
        MorphBench(early_checkpoint_step=2)
    with pytest.raises(ConfigError, match=r"MorphBench.steps_after must be a positive integer \(got 0\)"):
        MorphBench(steps_after=0)
    with pytest.raises(ConfigError, match=r"MorphBench.plain_write_settle_s must be >= 0 seconds \(got -1\)"):
        MorphBench(plain_write_settle_s=-1)


def test_plain_writes_keep_their_files_until_the_last(tmp_path: Path, monkeypatch) -> None:
    seen: list[int] = []
    real = driver.plain_write

    def spy(folder: Path, nbytes: int, **kw) -> dict[str, float]:
        seen.append(len(list(folder.iterdir())))
        return real(folder, nbytes, **kw)

    monkeypatch.setattr(driver, "plain_write", spy)
    fresh, warm = driver.plain_writes(tmp_path, 1 << 20, repeats=3, settle_s=0)
    assert seen == [0, 1, 2, 0]  # each new-page write finds the earlier files still there; the warm one none
    assert len(fresh) == 3 and all(r["mb_s"] > 0 for r in fresh) and warm["mb_s"] > 0
    assert list(tmp_path.iterdir()) == []
