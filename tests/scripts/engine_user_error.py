"""A model whose last block raises on the real forward: the error must surface with its traceback."""

from __future__ import annotations

import torch

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, gpt_tiny


class BrokenBlock(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the start-up passes are not training: the trace runs under no_grad, the memory check's
        # forward on the meta device
        if torch.is_grad_enabled() and not x.is_meta:
            raise ValueError("a bug in the user's block 3")
        return self.block(x)


torch.manual_seed(0)
cfg = gpt_tiny()
model = GPT(cfg)
model.blocks[3] = BrokenBlock(model.blocks[3])
data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 64)
engine = Varuna(
    model, global_batch_size=8, micro_batch_size=2, partition=[1], example_batch=collate([data[0], data[1]])
)
engine.step(engine.batch(data, 0))
