"""What every rank of the spot bench's job runs (``varuna run ... -m varuna.bench.spot.worker SPEC``).

A small GPT trained step after step until stopped, resuming from ``VARUNA_RESUME`` as the agent
relaunches it, with a background checkpoint every ``checkpoint_every`` steps. After each step a rank
sleeps ``device_s_per_sample x global batch / ranks``: a stand-in for the accelerator's time on its
share of the batch, so that a job's throughput grows with its ranks as it does on GPUs, which two
CPU cores shared by four ranks would not show; the CPU work of the step is real.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from varuna.bench.common import run_worker


def train(spec: dict[str, Any]) -> None:
    import torch

    from varuna import Varuna
    from varuna.data import SyntheticLM, collate
    from varuna.models import GPT, GPTConfig

    torch.manual_seed(spec["seed"])
    cfg = GPTConfig(**spec["model"])
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, spec["dataset_size"], seed=spec["seed"])
    engine = Varuna(
        GPT(cfg),
        global_batch_size=spec["global_batch_size"],
        micro_batch_size=spec["micro_batch_size"],
        partition="uniform",
        example_batch=collate([data[i] for i in range(spec["micro_batch_size"])]),
        checkpoint_every=spec["checkpoint_every"],
    )
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=spec["lr"]))
    pause = spec["device_s_per_sample"] * spec["global_batch_size"] / engine.world_size
    for step in range(engine.step_count, spec["steps"]):
        engine.step(engine.batch(data, step))
        time.sleep(pause)


if __name__ == "__main__":
    run_worker(sys.argv[1:], train)
