"""Trains a tiny GPT at P x D for 3 AdamW steps, checkpoints, and saves each rank's parameters and buffers.

    varuna run --pipeline 2 --data 2 tests/scripts/consolidate_worker.py OUT

`GPTExtras` is `GPT(gpt_tiny())` (tied embeddings) plus what the plain GPT lacks and a consolidation
must handle: a second name for a parameter only the last stage holds (so on rank 0 that alias is a
meta Parameter), a persistent buffer on each stage and a non-persistent one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from varuna.models import GPT, gpt_tiny


class GPTExtras(GPT):
    def __init__(self) -> None:
        super().__init__(gpt_tiny())
        self.alias = nn.Module()
        self.alias.weight = self.blocks[-1].ln_1.weight  # state_dict key "alias.weight", same Parameter
        self.blocks[0].register_buffer("seen", torch.zeros(3))
        self.blocks[-1].register_buffer("seen", torch.zeros(2, 2))
        self.blocks[-1].register_buffer("scratch", torch.zeros(4), persistent=False)


def main(out: Path) -> None:
    from varuna import Varuna
    from varuna.data import SyntheticLM, collate

    torch.manual_seed(0)
    model = GPTExtras()
    model.blocks[0].seen.fill_(3.0)  # values a fresh model does not have
    model.blocks[-1].seen.copy_(torch.arange(4.0).view(2, 2))
    cfg = model.config
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
    engine = Varuna(
        model,
        global_batch_size=8,
        micro_batch_size=2,
        partition=[1],  # blocks 0-1 | blocks 2-3: no profiling, and the alias lives on stage 1 only
        example_batch=collate([data[0], data[1]]),
    )
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    for step in range(3):
        engine.step(engine.batch(data, step))
    engine.checkpoint()
    held = {n: p.detach().clone() for n, p in engine.named_parameters()}
    held |= {n: b.clone() for n, b in model.named_buffers() if not b.is_meta}
    torch.save(held, out / f"rank{engine.rank}.pt")
    engine.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from consolidate_worker import main as imported_main  # GPTExtras named as the test imports it

    imported_main(Path(sys.argv[1]))
