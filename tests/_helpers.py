"""Paths and small builders shared by the test tiers (tests/conftest.py puts tests/ on sys.path)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, GPTConfig, gpt_tiny

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"


def make_gpt_engine(
    run_dir: Path, *, seed: int = 0, cfg: GPTConfig | None = None, batch: int = 8, **kw
) -> tuple[Varuna, SyntheticLM]:
    """A one-process GPT engine with AdamW and a StepLR scheduler, and its synthetic data."""
    torch.manual_seed(seed)
    cfg = cfg or gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    engine = Varuna(
        GPT(cfg),
        global_batch_size=batch,
        micro_batch_size=2,
        run_dir=run_dir,
        example_batch=collate([data[0], data[1]]),
        **kw,
    )
    opt = torch.optim.AdamW(engine.parameters(), lr=1e-2)
    engine.set_optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9))
    return engine, data


def run_bench(name: str, *, timeout: float) -> tuple[dict, str]:
    """`python -m varuna.bench NAME --json --quick` from the repository: its JSON report and stderr
    (the table and progress lines); the test fails with the stderr's tail if it exits non-zero."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "varuna.bench", name, "--json", "--quick"],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout), proc.stderr


def wait_job(proc: subprocess.Popen[bytes], log: Path, *, timeout: float) -> None:
    """Wait for a `varuna_popen` job that writes to `log`; a non-zero exit or a timeout (the job's
    process group is killed) fails the test with the log's tail."""
    import subprocess

    try:
        code: int | str = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "timeout"
    assert code == 0, f"{' '.join(map(str, proc.args))[-300:]} failed ({code}):\n{log.read_text()[-6000:]}"
