"""A training script for the controller tests: a tiny GPT, STEPS steps, SLEEP seconds after each.

    JobController.start([this, STEPS, SLEEP], pipeline=2, data=1)

It resumes from VARUNA_RESUME (set by the controller on relaunch) and has no signal handling of its
own: checkpoints, stops and morphs all come through the engine. Two settings for the spot test, from
the environment: TRAIN_CHECKPOINT_EVERY (steps: `checkpoint_every`, checkpoints in the background) and
TRAIN_HOLD_WRITES (a path: while that file exists, every rank's checkpoint data write waits before it
starts, so that a test can kill a host while a background write is in flight; a waiting rank says so in
the file `<path>.<pid>`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import GLOBAL_BATCH, MICRO_BATCH, build, dataset, optimizer  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.data import collate  # noqa: E402

steps, pause = int(sys.argv[1]), float(sys.argv[2])
every = os.environ.get("TRAIN_CHECKPOINT_EVERY")
hold = os.environ.get("TRAIN_HOLD_WRITES")
if hold:
    from varuna.checkpoint import storage

    write_data = storage.Writer.write_data

    def held_write(self, plan, planner):  # type: ignore[no-untyped-def]
        waiting = f"{hold}.{os.getpid()}"  # says this rank's write is held, for the test to see
        if os.path.exists(hold):
            Path(waiting).touch()
        while os.path.exists(hold):
            time.sleep(0.05)
        Path(waiting).unlink(missing_ok=True)
        return write_data(self, plan, planner)

    storage.Writer.write_data = held_write  # type: ignore[method-assign]
data = dataset("gpt")
engine = Varuna(
    build("gpt"),
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=MICRO_BATCH,
    partition="uniform",
    example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
    checkpoint_every=int(every) if every else None,
)
engine.set_optimizer(optimizer(engine.parameters()))
for step in range(engine.step_count, steps):
    loss = engine.step(engine.batch(data, step))
    if engine.rank == 0:
        print(f"step {step} loss {loss:.4f}", flush=True)
    time.sleep(pause)
