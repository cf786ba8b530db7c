"""A loss on an earlier layer's hidden states (output_hidden_states=True): on stage 1 that value is
a stand-in for what stage 0 computes, and the engine must refuse to train on it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hf_common import GLOBAL_BATCH, MICRO_BATCH, Data, build  # noqa: E402

from varuna import Varuna, auto_cut  # noqa: E402
from varuna.data import collate  # noqa: E402


class EarlyLayerLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = build("gpt2")

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, labels=labels, output_hidden_states=True)
        return out.loss + 1e-3 * out.hidden_states[1].pow(2).mean()  # the output of block 0


model = EarlyLayerLoss()
auto_cut(model)
data = Data("gpt2")
engine = Varuna(
    model,
    pipeline=2,
    data=1,
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=MICRO_BATCH,
    partition=[1],
    example_batch=collate([data[0], data[1]]),
)
engine.step(engine.batch(data, 0))
