"""A plain training script for `varuna profile` tests: it trains a tiny GPT with Varuna.

Under `varuna profile` the script stops at `Varuna(...)`, which hands its model and example batch
to the profiler; run directly (`varuna run -p 2 ...`) it trains two steps. `--layers N` sets the
number of blocks (so a test can see that arguments reach the script).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, gpt_tiny

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=4)
args = parser.parse_args()

torch.manual_seed(0)
cfg = dataclasses.replace(gpt_tiny(), n_layer=args.layers)
model = GPT(cfg)
dataset = SyntheticLM(cfg.vocab_size, cfg.seq_len, size=64)
engine = varuna.Varuna(
    model,
    global_batch_size=8,
    micro_batch_size=2,
    example_batch=collate([dataset[i] for i in range(4)]),
)
engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
for step in range(2):
    print(step, engine.step(engine.batch(dataset, step)))
