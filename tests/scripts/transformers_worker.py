"""Trains unmodified transformers models, cut by `auto_cut`, through the real engine.

Run as `varuna run --pipeline W --data 1 tests/scripts/transformers_worker.py OUT W PRETRAINED`:
one job serves every P x D with P * D == W (see hf_common.CONFIGS). World 2 also trains GPT-2
with dropout under 1F1B and under the recomputing `varuna` schedule from one seed, and a GPT-2
loaded with `from_pretrained` from PRETRAINED (written by the test with `save_pretrained`). World 4
checkpoints its 2x2 GPT-2, which the test consolidates into the plain model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_common import (  # noqa: E402
    CHUNK_RUNS,
    CONFIGS,
    GLOBAL_BATCH,
    MICRO_BATCH,
    MODELS,
    MORE_MODELS,
    STEPS,
    Data,
    build,
    optimizer,
    schedule_for,
)

from varuna import Varuna, auto_cut  # noqa: E402
from varuna.data import collate  # noqa: E402

out, world, pretrained = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])


def train(
    tag: str,
    model: torch.nn.Module,
    kind: str,
    P: int,
    D: int,
    schedule: str,
    seed: int | None = None,
    steps: int = STEPS,
) -> Varuna:
    data = Data(kind)
    auto_cut(model)
    engine = Varuna(
        model,
        pipeline=P,
        data=D,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        schedule=schedule,
        example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
    )
    engine.set_optimizer(optimizer(engine.parameters()))
    if seed is not None:
        torch.manual_seed(seed + engine.rank)
    losses = [engine.step(engine.batch(data, k)) for k in range(steps)]
    record: dict[str, Any] = {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in engine.named_parameters()},
        "stage": engine.stage,
        "boundaries": engine.partition.boundaries,
    }
    (out / tag).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / tag / f"rank{engine.rank}.pt")
    if tag == "gpt2-2x2":  # for varuna.consolidate -> the plain model -> save_pretrained
        engine.checkpoint(out / tag / "checkpoints")
    engine.close()
    return engine


for P, D in CONFIGS[world]:
    for kind in MODELS:
        train(f"{kind}-{P}x{D}", build(kind), kind, P, D, schedule_for(kind, (P, D)))

if world == 2:
    for kind, schedule in CHUNK_RUNS:
        train(f"{kind}-2x1-{schedule}", build(kind), kind, 2, 1, schedule)
    for kind in MORE_MODELS:
        train(f"{kind}-2x1", build(kind), kind, 2, 1, "1f1b")
    for schedule in ("1f1b", "varuna"):
        train(f"dropout-{schedule}", build("gpt2", dropout=0.1), "gpt2", 2, 1, schedule, seed=99)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(pretrained)
    model.train()
    train("pretrained", model, "gpt2", 2, 1, "1f1b")
