"""A training job for the preemption-notice tests: trains until stopped (or STEPS), no signal handling.

    varuna run -p 1 -d 2 tests/scripts/notice_train.py OUT STEPS [RESUME]

Checkpoints in the background every 2 steps, so that a notice is weighed against measured checkpoints.
Every rank writes its pid to OUT/pid-rank<r> once its engine exists; rank 0 appends each step's loss
and wall time to OUT/losses.jsonl, and writes OUT/ready after step 5 (every rank has measured a
checkpoint by then: the one of step 4 waited for the one of step 2).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from varuna import Varuna
from varuna.data import SyntheticLM
from varuna.models import GPT, gpt_tiny

out, steps = Path(sys.argv[1]), int(sys.argv[2])
resume = sys.argv[3] if len(sys.argv) > 3 else None
torch.manual_seed(0)
cfg = gpt_tiny()
data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 256, seed=7)
engine = Varuna(GPT(cfg), global_batch_size=8, micro_batch_size=2, checkpoint_every=2, resume=resume)
engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-3))
(out / f"pid-rank{engine.rank}").write_text(str(os.getpid()))
for step in range(engine.step_count, steps):
    loss = engine.step(engine.batch(data, step))
    if engine.rank == 0:
        with open(out / "losses.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "time": time.time()}) + "\n")
        if step == 5:
            (out / "ready").write_text(str(step))
engine.close()
