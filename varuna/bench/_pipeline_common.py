"""What the pipeline benchmark's workers share: the model, the batches, the learning rate."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from varuna.data import SyntheticLM, collate, global_indices
from varuna.models import GPT, GPTConfig

__all__ = ["LR", "SEED", "DATA_SEED", "_log", "_model", "_batches"]

LR = 1e-4
SEED = 0
DATA_SEED = 0


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _model(cfg: dict[str, Any]) -> GPT:
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**cfg))


def _batches(spec: dict[str, Any]) -> list[dict[str, Tensor]]:
    """The global batches of steps 0 .. warmup+steps-1, made before any timing starts."""
    cfg, B = spec["model"], spec["global_batch_size"]
    steps = spec["warmup"] + spec["steps"]
    ds = SyntheticLM(cfg["vocab_size"], cfg["seq_len"], max(B * steps, 1024), seed=DATA_SEED)
    return [collate([ds[i] for i in global_indices(s, B, len(ds))]) for s in range(steps)]
