"""The planner in use: `Varuna(..., pipeline="auto")` and `varuna resize --gpus N`.

Pure tests of `varuna.planner.auto` on synthetic tables, one-process engine errors, the shape a resize to
N devices asks for (`varuna.elastic.protocol.shape_for_gpus`, the CLI, `JobController.shape_for`), then real
2-rank jobs of a tiny GPT (`tests/scripts/auto_train.py`): the first profiles and plans, the second
reuses the cached profile with what the user fixed, a third asks for memory nothing fits in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_plan import uniform_table

from varuna import Varuna
from varuna.cli import main
from varuna.controller import JobController
from varuna.data import SyntheticLM, collate
from varuna.elastic.protocol import Shape, take_resize
from varuna.elastic.reshape import choose_shape, shape_for_gpus
from varuna.errors import ConfigError
from varuna.models import GPT, gpt_tiny
from varuna.planner.auto import Fixed, describe, plan_for, profile_sizes
from varuna.planner.costs import CostTable
from varuna.planner.search import PlanError
from varuna.schedule import SCHEDULES

GiB = 2**30


def test_profile_sizes_divide_the_batch() -> None:
    assert profile_sizes(8) == [1, 2, 4, 8]
    assert profile_sizes(96) == [4, 8, 16, 32]
    assert profile_sizes(6) == [1, 2]


def test_plan_for_keeps_what_the_user_fixed() -> None:
    table = uniform_table()
    free = plan_for(table, gpus=4, memory_bytes=64 * GiB, global_batch_size=32, fixed=Fixed())
    assert {c.schedule for c in free.ranked} == set(SCHEDULES)
    assert {c.pipeline for c in free.ranked} == {1, 2, 4}
    fixed = Fixed(micro_batch_size=2, data=2, schedule="1f1b", recompute=True)
    result = plan_for(table, gpus=4, memory_bytes=64 * GiB, global_batch_size=32, fixed=fixed)
    assert {(c.pipeline, c.data, c.micro_batch_size, c.schedule, c.recompute) for c in result.ranked} == {
        (2, 2, 2, "1f1b", True)
    }
    assert Fixed.from_json(json.loads(json.dumps(fixed.to_json()))) == fixed


def test_plan_for_bad_input_names_the_fix() -> None:
    table = uniform_table()
    kw = {"gpus": 4, "memory_bytes": 64 * GiB, "global_batch_size": 32}
    with pytest.raises(PlanError, match=r"data=3 does not divide the 4 devices"):
        plan_for(table, fixed=Fixed(data=3), **kw)  # type: ignore[arg-type]
    with pytest.raises(
        PlanError, match=r"micro-batch sizes \[3\] are not in the profile \(it has \[1, 2, 4\]\)"
    ):
        plan_for(table, fixed=Fixed(micro_batch_size=3), **kw)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"schedule='zb' is not one of"):
        plan_for(table, fixed=Fixed(schedule="zb"), **kw)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"a profile from another model"):
        plan_for(table, fixed=Fixed(), signature="not-this-one", **kw)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"zero GPUs"):
        plan_for(table, fixed=Fixed(), gpus=0, memory_bytes=GiB, global_batch_size=32)
    with pytest.raises(PlanError, match=r"nothing fits in 1.0 KiB per device"):
        plan_for(table, fixed=Fixed(), gpus=4, memory_bytes=1024, global_batch_size=32)


def test_describe_says_the_plan_was_used() -> None:
    result = plan_for(uniform_table(), gpus=2, memory_bytes=64 * GiB, global_batch_size=8, fixed=Fixed())
    info = {
        "best": result.best.to_json(),
        "candidates": len(result.ranked),
        "gpus": 2,
        "memory_bytes": 64 * GiB,
        "profile": "runs/x/profile.json",
        "profile_reused": True,
    }
    text = describe(info)
    assert (
        text.startswith("planned (pipeline='auto'): best of ")
        and "cached profile runs/x/profile.json" in text
    )


def run_dir(tmp_path: Path, *, profile: CostTable | None, **engine: object) -> Path:
    """A run directory as a training job leaves it: engine.json (2x2, micro-batches of 2), a profile."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    info = {
        "pipeline": 2,
        "data": 2,
        "global_batch_size": 32,
        "micro_batch_size": 2,
        "schedule": "1f1b",
        "recompute": None,
        "num_segments": 8,
        "memory_limit": "64GiB",
        "model_signature": "synthetic",
        "plan": None,
    } | engine
    (run / "engine.json").write_text(json.dumps(info))
    if profile is not None:
        profile.save(run / "profile.json")
    return run


def test_resize_uses_the_planner_when_the_run_has_a_profile(tmp_path: Path) -> None:
    run = run_dir(tmp_path, profile=uniform_table())
    choice = shape_for_gpus(run, 4)
    expected = plan_for(
        uniform_table(),
        gpus=4,
        memory_bytes=64 * GiB,
        global_batch_size=32,
        fixed=Fixed(micro_batch_size=2, schedule="1f1b", recompute=False),
    ).best
    assert choice.chosen_by == "planner" and choice.shape == Shape(expected.pipeline, expected.data)
    assert choice.reason.startswith(f"planner ({run / 'profile.json'}): predicted ")
    assert "micro-batches of 2, 1f1b" in choice.reason
    # the depth rule would have kept P = 2
    assert choose_shape(4, json.loads((run / "engine.json").read_text())) == Shape(2, 2) != choice.shape
    assert JobController(run).shape_for(4) == choice


def test_resize_of_an_auto_run_plans_what_the_engine_will(tmp_path: Path) -> None:
    auto = {"fixed": {"micro_batch_size": None, "data": None, "schedule": None, "recompute": None}}
    run = run_dir(tmp_path, profile=uniform_table(), plan=auto)
    best = plan_for(uniform_table(), gpus=4, memory_bytes=64 * GiB, global_batch_size=32, fixed=Fixed()).best
    choice = shape_for_gpus(run, 4)
    assert choice.shape == Shape(best.pipeline, best.data)
    assert f"micro-batches of {best.micro_batch_size}, {best.schedule}" in choice.reason


def test_resize_falls_back_to_the_depth_rule_and_says_why(tmp_path: Path) -> None:
    bare = run_dir(tmp_path / "a", profile=None)
    choice = shape_for_gpus(bare, 4)
    assert (choice.shape, choice.chosen_by) == (Shape(2, 2), "rule")
    assert choice.reason == f"rule (no profile in {bare}): keep the pipeline depth near 2"
    other = run_dir(tmp_path / "b", profile=uniform_table(), model_signature="another")
    choice = shape_for_gpus(other, 4)
    assert choice.chosen_by == "rule" and "is a profile of another model" in choice.reason


def test_resize_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path, profile=uniform_table())
    with pytest.raises(ConfigError, match=r"zero GPUs: --gpus must be at least 1, got 0"):
        shape_for_gpus(run, 0)
    with pytest.raises(ConfigError, match=r"has no engine.json yet"):
        shape_for_gpus(tmp_path, 2)
    tight = run_dir(tmp_path / "tight", profile=uniform_table(), memory_limit="1KiB")
    with pytest.raises(PlanError, match=r"nothing fits in 1.0 KiB per device"):
        shape_for_gpus(tight, 4)
    assert main(["resize", str(run), "--gpus", "0", "--no-signal"]) == 2
    assert "varuna: error: zero GPUs" in capsys.readouterr().err


def test_cli_resize_gpus_says_how_it_chose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = run_dir(tmp_path, profile=uniform_table())
    planned = shape_for_gpus(run, 4).shape
    assert main(["resize", str(run), "--gpus", "4", "--no-signal"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"varuna: requested {planned.pipeline}x{planned.data} for {run} (resize-")
    assert ", chosen by the planner (" in out and take_resize(run) == planned
    (run / "profile.json").unlink()
    assert main(["resize", str(run), "--gpus", "4", "--no-signal"]) == 0
    assert ", chosen by the rule (no profile in" in capsys.readouterr().out
    assert take_resize(run) == Shape(2, 2)


@pytest.fixture()
def tiny() -> tuple[GPT, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 16)
    return GPT(cfg), collate([data[i] for i in range(8)])


def test_one_process_auto_is_1x1_and_says_so(tiny: tuple[GPT, dict[str, torch.Tensor]]) -> None:
    model, batch = tiny
    engine = Varuna(model, global_batch_size=8, pipeline="auto", example_batch=batch)
    c = engine.config
    assert (c.pipeline, c.data, c.micro_batch_size, c.schedule) == (1, 1, 8, "1f1b")
    assert engine.plan_info is not None and "planned (pipeline='auto'): one process" in engine.describe()
    assert engine.step(batch) > 0
    engine.close()


def test_auto_bad_input(tiny: tuple[GPT, dict[str, torch.Tensor]]) -> None:
    model, batch = tiny
    with pytest.raises(ConfigError, match=r"pipeline='auto' needs example_batch="):
        Varuna(model, global_batch_size=8, pipeline="auto")
    with pytest.raises(ConfigError, match=r"pipeline='auto' chooses the stage boundaries itself.*'uniform'"):
        Varuna(model, global_batch_size=8, pipeline="auto", example_batch=batch, partition="uniform")
    with pytest.raises(ConfigError, match=r"cannot read the memory size 'lots'"):
        Varuna(model, global_batch_size=8, pipeline="auto", example_batch=batch, memory_limit="lots")
    with pytest.raises(ConfigError, match=r"micro_batch_size is required \(or pass pipeline='auto'"):
        Varuna(model, global_batch_size=8)
