"""A transformers GPT-2 with Hugging Face's own gradient checkpointing (`gradient_checkpointing_enable`),
trained at 2x1 by the real engine: OUT/rank<r>.pt holds the losses and the stage's final parameters.

    varuna run --pipeline 2 tests/scripts/hf_checkpointing_train.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_common import GLOBAL_BATCH, MICRO_BATCH, STEPS, Data, build, optimizer  # noqa: E402

from varuna import Varuna, auto_cut  # noqa: E402
from varuna.data import collate  # noqa: E402

out = Path(sys.argv[1])
model = build("gpt2")
model.gradient_checkpointing_enable()
auto_cut(model)
data = Data("gpt2")
engine = Varuna(
    model,
    pipeline=2,
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=MICRO_BATCH,
    partition=[1],
    example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
)
engine.set_optimizer(optimizer(engine.parameters()))
assert model.is_activation_checkpointing
calls = {"n": 0}
block = model.transformer.h[3 * engine.stage].attn  # inside a block this stage runs (recomputed)
block.register_forward_pre_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
out.mkdir(parents=True, exist_ok=True)
torch.save(
    {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in engine.named_parameters()},
        "block_calls": calls["n"],
        "forwards": STEPS * GLOBAL_BATCH // MICRO_BATCH,
    },
    out / f"rank{engine.rank}.pt",
)
