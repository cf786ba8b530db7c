"""Real 2-rank jobs of a tiny GPT with pipeline="auto" (tests/scripts/auto_train.py): the first profiles and
plans, the second reuses the cached profile with what the user fixed, a third asks for memory nothing fits in.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from _helpers import REPO, SCRIPTS

from varuna.models import GPT, gpt_tiny
from varuna.planner.costs import CostTable, model_signature
from varuna.schedule import schedule_spec

pytestmark = pytest.mark.multirank


def _launch(varuna_run, run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return varuna_run(
        [SCRIPTS / "auto_train.py", out, *extra],
        pipeline=2,
        run_dir=run_dir,
        flags=["--timeout", "80"],
        env={"VARUNA_TIMEOUT": "60"},
        cwd=REPO,
        timeout=100,
        check=False,
    )


def _ranks(out: Path) -> list[dict[str, object]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_auto_profiles_once_plans_and_every_rank_agrees(tmp_path: Path, varuna_run) -> None:
    run = tmp_path / "run"
    first = _launch(varuna_run, run, tmp_path / "first")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-4000:]
    assert "pipeline='auto': profiling the model (no profile yet)" in first.stdout
    table = CostTable.load(run / "profile.json")
    assert table.model_signature == model_signature(GPT(gpt_tiny()))
    assert table.micro_batch_sizes == [1, 2, 4, 8] and set(table.compute_slowdown) == {1, 2}
    a, b = _ranks(tmp_path / "first")
    assert a["shape"] == b["shape"] and a["boundaries"] == b["boundaries"] and a["losses"] == b["losses"]
    plan = a["plan"]
    assert isinstance(plan, dict) and plan == b["plan"] and plan["profile_reused"] is False
    best = plan["best"]
    assert a["shape"][:4] == [best["pipeline"], best["data"], best["micro_batch_size"], best["schedule"]]
    assert best["pipeline"] * best["data"] == 2 and a["boundaries"] == best["boundaries"]
    info = json.loads((run / "engine.json").read_text())
    assert info["plan"] == plan and info["pipeline"] == best["pipeline"]
    assert "planned (pipeline='auto'): best of" in first.stdout and "new profile" in first.stdout

    # the second launch reuses the cached profile; what the user fixes stays fixed
    second = _launch(varuna_run, run, tmp_path / "second", "--micro-batch-size", "2", "--data", "1")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    assert "profiling the model" not in second.stdout and "cached profile" in second.stdout
    a, b = _ranks(tmp_path / "second")
    assert a["shape"] == b["shape"] and a["shape"][:3] == [2, 1, 2]
    plan = a["plan"]
    assert isinstance(plan, dict) and plan["profile_reused"] is True
    assert plan["fixed"] == {"micro_batch_size": 2, "data": 1, "schedule": None, "recompute": None}
    # P - 1 cuts, or P x V - 1 where the planner picked a schedule whose ranks hold V chunks each
    cuts = 2 * schedule_spec(a["shape"][3]).chunks_per_rank - 1
    assert a["boundaries"] == plan["best"]["boundaries"] and len(a["boundaries"]) == cuts
    assert CostTable.load(run / "profile.json") == table  # not measured again

    # nothing fits: every rank raises the planner's error, which names the fix
    third = _launch(varuna_run, run, tmp_path / "third", "--memory", "1KiB")
    assert third.returncode == 1
    text = third.stdout + third.stderr
    assert "PlanError: pipeline='auto': nothing fits in 1.0 KiB per device" in text
    assert "raise --memory to at least that" in text
