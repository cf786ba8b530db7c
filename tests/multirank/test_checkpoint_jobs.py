"""Checkpoints across processes: a SIGKILL during a write, and damage found by one rank of two."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import REPO
from _helpers import make_gpt_engine as make

pytestmark = pytest.mark.multirank


KILLER = """
import os, signal, sys, torch
import varuna.checkpoint.storage as cio
from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, gpt_tiny
torch.manual_seed(0)
cfg = gpt_tiny()
data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
engine = Varuna(GPT(cfg), global_batch_size=8, micro_batch_size=2, run_dir=sys.argv[1])
engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
engine.step(engine.batch(data, 0))
engine.checkpoint()
engine.step(engine.batch(data, 1))
cio.file_crc = lambda path: os.kill(os.getpid(), signal.SIGKILL)  # dies after the data, before the commit
engine.checkpoint()
"""


@pytest.mark.timeout(120)
def test_kill_during_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path)], env=env, capture_output=True, timeout=100
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    root = tmp_path / "checkpoints"
    assert (root / ".step-00000002.tmp").is_dir()  # the interrupted write
    assert not (root / "step-00000002").exists()
    assert (root / "latest").read_text().strip() == "step-00000001"
    engine, data = make(tmp_path, resume="latest")
    assert engine.step_count == 1
    engine.step(engine.batch(data, 1))
    engine.checkpoint()  # the next save replaces the debris
    assert not (root / ".step-00000002.tmp").exists() and (root / "step-00000002").is_dir()
    engine.close()


TWO_RANKS = """
import sys, torch, torch.distributed as dist
from varuna import Varuna
from varuna.data import SyntheticLM
from varuna.errors import CheckpointError
from varuna.models import GPT, gpt_tiny
torch.manual_seed(0)
cfg = gpt_tiny()
data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
resume = None if sys.argv[1] == "fresh" else sys.argv[1]
try:
    engine = Varuna(GPT(cfg), global_batch_size=8, micro_batch_size=2, resume=resume)
except CheckpointError as exc:
    print(f"refused on rank {dist.get_rank()}: {exc}", flush=True)
    sys.exit(0)
engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
engine.step(engine.batch(data, 0))
engine.checkpoint()
"""


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_damage_found_by_one_rank_fails_the_load_on_every_rank(tmp_path: Path, varuna_run) -> None:
    """At 1x2 both ranks read every tensor and each checks about half of them: the one that finds the
    damage and the one that does not both raise the error naming the file."""
    script, run = tmp_path / "two_ranks.py", tmp_path / "run"
    script.write_text(TWO_RANKS)

    def job(resume: str) -> str:
        proc = varuna_run(
            [script, resume], pipeline=1, data=2, run_dir=run, cwd=tmp_path, timeout=150, check=False
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc.stdout + proc.stderr

    job("fresh")
    saved = run / "checkpoints" / "step-00000001"
    files = sorted(saved.glob("*.distcp"))
    assert len(files) == 2  # the replicas' copies are written once, split over both ranks
    victim = files[1]  # one byte of one tensor: exactly one of the ranks checks it
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    text = job(str(saved))
    for rank in (0, 1):
        assert re.search(
            rf"refused on rank {rank}: checkpoint file .*{victim.name} is corrupted: the bytes of '", text
        ), text
