"""`varuna run` inside a real Slurm allocation (Debian's slurm-wlm: munged, slurmctld and slurmd started
here, as root, for this module; `slurm_cluster.SlurmCluster`).

- An sbatch job of 2 tasks runs `varuna run --elastic -p 2`: srun starts the ranks, which meet through
  the run directory; `varuna resize --gpus 4` (and `-p 2 -d 2`) beyond the 2 slots are refused with a
  typed error, `--gpus 1` morphs the job to 1x1 inside the allocation; every loss equals plain training.
- A shape beyond the allocation is refused before anything starts.
- A rank that fails takes the step down (srun --kill-on-bad-exit) and is named first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _helpers import REPO, SCRIPTS
from slurm_cluster import SlurmCluster, slurm_unavailable

sys.path.insert(0, str(SCRIPTS))
from transparency_common import reference  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(150)]


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    """A one-node Slurm (this machine, 2 CPUs) for the module; every process of it ended afterwards."""
    reason = slurm_unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=2).up()
    try:
        yield cluster
    finally:
        cluster.down()


def _env(slurm: SlurmCluster) -> dict[str, str]:
    return slurm.env({**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def _varuna(
    slurm: SlurmCluster, *args: str, cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "varuna", *args], env=_env(slurm), cwd=cwd, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def job_id(console: str) -> str:
    """The Slurm job id in `varuna run`'s first line (``..., srun in Slurm job 7: 2 task slots ...``)."""
    return console.split("srun in Slurm job ", 1)[1].split(":", 1)[0]


def _records(out: Path) -> list[dict]:
    path = out / "losses.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_multihost_slurm_sbatch_job_trains_and_resizes_inside_its_allocation(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # 100 steps (~0.04 s each at 2x1): `varuna resize` (a fresh interpreter) lands well before the end
    run, out, steps = tmp_path / "run", tmp_path / "out", 100
    out.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --ntasks=2\n"
        f"exec {sys.executable} -m varuna run --elastic --pipeline 2 --run-dir {run} "
        f"{SCRIPTS / 'morph_train.py'} {out} {steps} fp32\n"
    )
    log = tmp_path / "slurm.out"
    job = subprocess.Popen(
        ["sbatch", "--wait", f"--output={log}", str(script)], env=_env(slurm), cwd=tmp_path,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while len(_records(out)) < 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_records(out)) >= 2, f"no training steps:\n{log.read_text() if log.exists() else ''}"
        asked = _varuna(slurm, "resize", str(run), "--gpus", "1", cwd=tmp_path)
        assert asked.returncode == 0, asked.stderr
        sbatch_out, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    assert job.returncode == 0, sbatch_out + text[-4000:]
    for args in (["--gpus", "4"], ["-p", "2", "-d", "2"]):  # job.json keeps the allocation: 2 slots
        refused = _varuna(slurm, "resize", str(run), *args, "--no-signal", cwd=tmp_path)
        assert refused.returncode == 2, refused.stderr
        assert (
            f"needs 4 ranks but Slurm job {job_id(text)}: 2 task slots on {slurm.node} (2)" in refused.stderr
        )
    meta = json.loads((run / "job.json").read_text())
    assert meta["launcher"] == "srun" and Path(meta["command"][0]).name == "srun"
    assert meta["slurm"]["hosts"] == [slurm.node] and meta["slurm"]["tasks"] == [2]
    assert (
        json.loads((run / "rendezvous.json").read_text())["job_id"] == meta["job_id"]
    )  # met through run dir
    assert "srun in Slurm job" in text and "morphing 2x1 -> 1x1" in text
    records = _records(out)
    assert [r["step"] for r in records] == list(range(steps))
    morph_at = next(i for i, r in enumerate(records) if r["shape"] == "1x1")
    assert 2 <= morph_at < steps and {r["shape"] for r in records[:morph_at]} == {"2x1"}
    ref_losses, _ = reference("gpt", steps=steps)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in records]), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )


def test_multihost_slurm_shape_beyond_the_allocation_is_refused(slurm: SlurmCluster, tmp_path: Path) -> None:
    done = subprocess.run(
        ["salloc", "--ntasks=2", "--", sys.executable, "-m", "varuna", "run", "-p", "2", "-d", "2",
         "--run-dir", str(tmp_path / "run"), "-m", "varuna.demo"],
        env=_env(slurm), cwd=tmp_path, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "varuna: error: pipeline 2 x data 2 needs 4 ranks but Slurm job" in done.stderr
    assert f"2 task slots on {slurm.node} (2); ask for more tasks" in done.stderr
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_multihost_slurm_failing_rank_ends_the_step_and_is_named(slurm: SlurmCluster, tmp_path: Path) -> None:
    started = time.monotonic()
    done = subprocess.run(
        ["salloc", "--ntasks=2", "--", sys.executable, "-m", "varuna", "run", "-p", "2",
         "--run-dir", str(tmp_path / "run"), str(SCRIPTS / "launch_fail.py"), "raise"],
        env=_env(slurm), cwd=tmp_path, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("varuna: rank")]
    assert said[0].startswith("varuna: rank 1 (stage 1, replica 0) failed: ValueError: boom"), said
    assert time.monotonic() - started < 60  # rank 0 sat in a barrier for 120 s: srun ended it
