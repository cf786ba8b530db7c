"""Checkpoints across processes: a SIGKILL during a write, a full disk under one rank of two, and damage
found by one rank of two."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import REPO
from _helpers import make_gpt_engine as make

from varuna.checkpoint import layout as ckpt

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
import json, os, sys, torch, torch.distributed as dist
from pathlib import Path
import varuna.checkpoint.storage as cio
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
if resume is None:  # then the disk fills up under rank 1's data file: the kernel's ENOSPC from /dev/full
    engine.step(engine.batch(data, 1))
    real = cio.Writer.write_data
    def full(self, plan, planner):
        if dist.get_rank() == 1:
            (Path(self.path) / f"{plan.storage_data.prefix}0.distcp").symlink_to("/dev/full")
        return real(self, plan, planner)
    cio.Writer.write_data = full
    try:
        engine.checkpoint()
    except CheckpointError as exc:
        print(f"full disk on rank {dist.get_rank()}: {exc}", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        print("left:", json.dumps(sorted(os.listdir(Path(os.environ["VARUNA_RUN_DIR"]) / "checkpoints"))), flush=True)
"""


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, varuna_run) -> tuple[Path, Path, str]:
    """A 1x2 job that saved step-00000001, then failed to save step 2 on a full disk: the script,
    the run directory and the output."""
    base = tmp_path_factory.mktemp("two_ranks")
    script, run = base / "two_ranks.py", base / "run"
    script.write_text(TWO_RANKS)
    proc = varuna_run([script, "fresh"], pipeline=1, data=2, run_dir=run, cwd=base, timeout=150, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return script, run, proc.stdout + proc.stderr


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank(fresh: tuple[Path, Path, str]) -> None:
    _, run, text = fresh
    for rank in (0, 1):
        assert re.search(
            rf"full disk on rank {rank}: checkpoint file .*__1_0.distcp could not be written: No space left on "
            r"device \(ENOSPC\); the disk is full: free space there or lower checkpoint_keep. The checkpoint was "
            "not committed",
            text,
        ), text
    assert 'left: ["latest", "step-00000001"]' in text  # no .step-00000002.tmp, no .latest.tmp
    root = run / "checkpoints"
    assert (root / "latest").read_text().strip() == "step-00000001"
    ckpt.verify(root / "step-00000001", deep=True)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_damage_found_by_one_rank_fails_the_load_on_every_rank(
    tmp_path: Path, varuna_run, fresh: tuple[Path, Path, str]
) -> None:
    """At 1x2 both ranks read every tensor and each checks about half of them: the one that finds the
    damage and the one that does not both raise the error naming the file."""
    script, run, _ = fresh
    saved = tmp_path / "step-00000001"
    shutil.copytree(run / "checkpoints" / "step-00000001", saved)
    files = sorted(saved.glob("*.distcp"))
    assert len(files) == 2  # the replicas' copies are written once, split over both ranks
    victim = files[1]  # one byte of one tensor: exactly one of the ranks checks it
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    proc = varuna_run(
        [script, saved], pipeline=1, data=2, run_dir=tmp_path / "run", cwd=tmp_path, timeout=150, check=False
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    for rank in (0, 1):
        assert re.search(
            rf"refused on rank {rank}: checkpoint file .*{victim.name} is corrupted: the bytes of '", text
        ), text


BACKGROUND = """
import json, os, signal, sys, torch
from pathlib import Path
import varuna.checkpoint.storage as cio
from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, gpt_tiny
torch.manual_seed(0)
cfg = gpt_tiny()
data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
out, mode = Path(sys.argv[1]), sys.argv[2]
resume = sys.argv[3] if len(sys.argv) > 3 else None
engine = Varuna(GPT(cfg), pipeline=2, data=2, global_batch_size=16, micro_batch_size=2, resume=resume,
                example_batch=collate([data[0], data[1]]),
                checkpoint_every=2 if mode == "every" else None, checkpoint_keep=5)
engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
if mode == "kill":  # a background write that dies (SIGKILL, rank 0) after its data, before the commit
    engine.step(engine.batch(data, 0))
    engine.checkpoint()
    engine.step(engine.batch(data, 1))
    if engine.rank == 0:
        cio.file_crc = lambda path: os.kill(os.getpid(), signal.SIGKILL)
    engine.checkpoint(blocking=False)
    engine.step(engine.batch(data, 2))
    engine.wait_checkpoint()
losses = [engine.step(engine.batch(data, k)) for k in range(engine.step_count, 6)]
engine.close()
(out / f"{mode}-rank{engine.rank}.json").write_text(json.dumps({"losses": losses, "last": engine.last_checkpoint}))
"""


@pytest.mark.timeout(300)
def test_background_checkpoints_at_2x2_resume_exactly_and_a_killed_write_keeps_the_previous(
    tmp_path: Path, varuna_run
) -> None:
    """2x2 with checkpoint_every=2: steps 2 and 4 written in the background while steps 3-6 train
    (the writes' collectives on a group of their own); a job resumed from step 4 trains steps 5 and 6
    to the same losses. A background write killed before its commit leaves the previous checkpoint
    latest."""
    import json

    script = tmp_path / "background.py"
    script.write_text(BACKGROUND)
    run = tmp_path / "run"
    varuna_run([script, tmp_path, "every"], pipeline=2, data=2, run_dir=run, cwd=tmp_path, timeout=240)
    every = json.loads((tmp_path / "every-rank0.json").read_text())
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]
    assert every["last"]["blocking"] is False and every["last"]["step"] == 6
    varuna_run(
        [script, tmp_path, "resumed", str(root / "step-00000004")],
        pipeline=2,
        data=2,
        run_dir=tmp_path / "run-resumed",
        cwd=tmp_path,
        timeout=240,
    )
    resumed = json.loads((tmp_path / "resumed-rank0.json").read_text())
    assert resumed["losses"] == every["losses"][4:]

    killed = varuna_run(
        [script, tmp_path, "kill"],
        pipeline=2,
        data=2,
        run_dir=tmp_path / "run-kill",
        cwd=tmp_path,
        timeout=240,
        check=False,
    )
    assert killed.returncode != 0
    kill_root = tmp_path / "run-kill" / "checkpoints"
    assert (kill_root / "latest").read_text().strip() == "step-00000001"
    assert not (kill_root / "step-00000002").exists()
