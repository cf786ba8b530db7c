"""A training script with `Varuna(..., pipeline="auto")` for tests/multirank/test_auto_pipeline_jobs.py.

    varuna run -p W --run-dir RUN tests/scripts/auto_train.py OUT [--micro-batch-size M] [--data D]
        [--memory SIZE]

Trains a tiny GPT for two steps; every rank writes OUT/rank<r>.json with the configuration its
engine runs, the plan record and the losses, and rank 0 prints `engine.describe()`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, gpt_tiny

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--micro-batch-size", type=int)
parser.add_argument("--data", type=int)
parser.add_argument("--memory")
args = parser.parse_args()

torch.manual_seed(0)
cfg = gpt_tiny()
dataset = SyntheticLM(cfg.vocab_size, cfg.seq_len, size=64)
options = {"memory_limit": args.memory} if args.memory else {}
engine = varuna.Varuna(
    GPT(cfg),
    global_batch_size=8,
    micro_batch_size=args.micro_batch_size,
    data=args.data,
    pipeline="auto",
    example_batch=collate([dataset[i] for i in range(8)]),
    profile_repeats=1,
    **options,
)
engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
losses = [engine.step(engine.batch(dataset, step)) for step in range(2)]
if engine.rank == 0:
    print(engine.describe(), flush=True)
c = engine.config
args.out.mkdir(parents=True, exist_ok=True)
(args.out / f"rank{engine.rank}.json").write_text(
    json.dumps(
        {
            "shape": [c.pipeline, c.data, c.micro_batch_size, c.schedule, c.uses_recompute],
            "boundaries": list(engine.partition.boundaries),
            "plan": engine.plan_info,
            "losses": losses,
        }
    )
)
