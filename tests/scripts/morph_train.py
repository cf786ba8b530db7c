"""An elastic training script for the morph tests: no signal handling of its own.

    varuna run --elastic -p 2 -d 2 tests/scripts/morph_train.py OUT STEPS PRECISION [SIGNAL_AT ...]

Rank 2 (or rank 0 when the job is smaller) sends itself SIGUSR1 during each SIGNAL_AT-th step, as a
spot-VM preemption would (SIGNAL_AT 0: rank 0, before it builds its Varuna); rank 0 appends every step's loss and loss scale to OUT/losses.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import GLOBAL_BATCH, MICRO_BATCH, build, dataset, optimizer  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.data import collate  # noqa: E402

out, steps, precision = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
signal_at = {int(s) for s in sys.argv[4:]}
if 0 in signal_at and torch.distributed.get_rank() == 0:  # before Varuna() exists: the worker keeps it
    os.kill(os.getpid(), signal.SIGUSR1)
data = dataset("gpt")
engine = Varuna(
    build("gpt"),
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=MICRO_BATCH,
    precision=precision,
    init_loss_scale=2.0**30,  # fp16: overflows first, so the scale that carries over is not the initial one
    example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
)
engine.set_optimizer(optimizer(engine.parameters()))
shape = f"{engine.config.pipeline}x{engine.config.data}"
signaller = 2 if engine.world_size > 2 else 0
for step in range(engine.step_count, steps):
    if step + 1 in signal_at and engine.rank == signaller:
        os.kill(os.getpid(), signal.SIGUSR1)  # arrives during this step; the morph follows it
    loss = engine.step(engine.batch(data, step))
    if engine.rank == 0:
        scale = engine.scaler.scale if engine.scaler is not None else None
        record = {
            "step": step,
            "loss": loss,
            "shape": shape,
            "scale": scale,
            "skipped": engine.last_step_skipped,
        }
        with open(out / "losses.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
params = {n: p.detach().clone() for n, p in engine.named_parameters()}
torch.save(params, out / f"final-rank{engine.rank}.pt")
