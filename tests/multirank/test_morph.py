"""Morphing: change P x D mid-training from the command line and lose nothing.

fp32: 6 steps at 2x2, SIGUSR1 to one worker, resume at 4x1, again at step 12 to 1x2, on to step 18:
the 18 losses and the final parameters equal an uninterrupted 18-step run at 1x1. fp16: a resize
requested with `varuna resize` while the job runs: the loss scale carries over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _helpers import REPO as ROOT
from _helpers import SCRIPTS

from varuna.checkpoint.layout import read_extra

SCRIPT = SCRIPTS / "morph_train.py"
sys.path.insert(0, str(SCRIPTS))
from transparency_common import (  # noqa: E402
    assert_rel_close,
    reference,
)

pytestmark = pytest.mark.multirank
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def varuna(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "varuna", *args], env=ENV, capture_output=True, text=True, **kw
    )


def start_job(
    varuna_popen, tmp_path: Path, flags: list[str], out: Path, *args: str, steps_before: int
) -> subprocess.Popen:
    """Start `varuna run [flags] -p 2 -d 2` of the morph script; return once it has logged some steps."""
    job = varuna_popen(
        [SCRIPT, out, *args],
        pipeline=2,
        data=2,
        run_dir=tmp_path / "run",
        flags=flags,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 150
    while len(records(out)) < steps_before and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return job


def records(out: Path) -> list[dict]:
    path = out / "losses.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_morph_2x2_to_4x1_to_1x2_equals_uninterrupted_training(tmp_path: Path, varuna_run) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    for p, d in ((4, 1), (1, 2)):  # queued shapes for the two morphs, taken in order
        assert varuna("resize", str(run), "-p", str(p), "-d", str(d), "--no-signal").returncode == 0
    job = varuna_run(
        [SCRIPT, out, "18", "fp32", "6", "12"],
        pipeline=2,
        data=2,
        run_dir=run,
        flags=["--elastic"],
        cwd=tmp_path,
        timeout=280,
        check=False,
    )
    text = job.stdout + job.stderr
    assert job.returncode == 0, text[-4000:]
    assert text.count("ready to morph (exit status 75)") == 2
    assert "morphing 2x2 -> 4x1" in text and "morphing 4x1 -> 1x2" in text
    steps = records(out)
    assert [r["step"] for r in steps] == list(range(18))
    assert [r["shape"] for r in steps] == ["2x2"] * 6 + ["4x1"] * 6 + ["1x2"] * 6
    ref_losses, ref_params = reference("gpt", steps=18)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in steps]), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )
    for f in sorted(out.glob("final-rank*.pt")):
        for name, value in torch.load(f, weights_only=True).items():
            assert_rel_close(value, ref_params[name], 1e-5, name)
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000012"


@pytest.mark.timeout(300)
def test_resize_from_the_cli_while_running_keeps_the_fp16_loss_scale(tmp_path: Path, varuna_popen) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    # 40 steps: the resize command (a fresh interpreter importing torch) must land before the last
    # one even on a loaded host; with 14, a CI run under full load once finished first
    job = start_job(varuna_popen, tmp_path, ["--elastic"], out, "40", "fp16", steps_before=5)
    resize = varuna("resize", str(run), "-p", "1", "-d", "2")
    assert resize.returncode == 0, resize.stderr
    text, _ = job.communicate(timeout=240)
    assert job.returncode == 0, text[-4000:]
    assert "morphing 2x2 -> 1x2" in text
    steps = records(out)
    assert [r["step"] for r in steps] == list(range(40))
    morph_at = next(i for i, r in enumerate(steps) if r["shape"] == "1x2")
    assert 5 <= morph_at < 40
    before, after = steps[morph_at - 1]["scale"], steps[morph_at]["scale"]
    # the scale fell from 2^30 through overflows before the morph ...
    assert before <= 2.0**24 and any(r["skipped"] for r in steps[:morph_at])
    # ... and carries over: the resumed step starts from it (halving only if that step overflows)
    assert after in (before, before / 2)
    extra = read_extra(run / "checkpoints" / f"step-{morph_at:08d}")
    assert extra["scaler"]["scale"] == before
    losses = [r["loss"] for r in steps if not r["skipped"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def _live(run: Path) -> dict[int, int]:
    statuses = [json.loads(p.read_text()) for p in run.glob("status/rank*.json")]
    return {s["rank"]: s["pid"] for s in statuses if s.get("state") == "running"}


@pytest.mark.timeout(200)
def test_sigkill_of_a_worker_mid_step_ends_the_job_fast(tmp_path: Path, varuna_popen) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    job = start_job(varuna_popen, tmp_path, [], out, "100000", "fp32", steps_before=3)
    pids = _live(run)
    assert len(pids) == 4, pids
    os.kill(pids[1], 9)
    killed = time.monotonic()
    text, _ = job.communicate(timeout=60)
    elapsed = time.monotonic() - killed
    assert job.returncode != 0
    assert elapsed < 5.0, f"the job took {elapsed:.1f} s to end after the kill"
    assert "rank 1 (stage 1, replica 0)" in text and (
        "signal 9" in text or "died without a Python exception" in text
    )
    for pid in pids.values():  # nothing left behind
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
        )


@pytest.mark.timeout(200)
def test_sigusr1_before_varuna_exists_is_honoured_after_the_first_step(tmp_path: Path, varuna_run) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    job = varuna_run(
        [SCRIPT, out, "3", "fp32", "0"], pipeline=1, run_dir=run, cwd=tmp_path, timeout=180, check=False
    )
    text = job.stdout + job.stderr
    assert job.returncode == 75, text[-4000:]  # checkpointed and stopped to morph; SIGUSR1 used to kill it
    assert "a stop request (SIGUSR1) arrived before Varuna() existed" in text
    assert [r["step"] for r in records(out)] == [0]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000001"
