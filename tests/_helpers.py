"""Paths and small builders shared by the test tiers (tests/conftest.py puts tests/ on sys.path)."""

from __future__ import annotations

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
