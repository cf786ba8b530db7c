"""An elastic training script that reads an iterable dataset (tests/multirank/test_data_jobs.py).

    varuna run --elastic -p 2 -d 2 tests/scripts/data_stream_train.py OUT STEPS SIGNAL_AT

The stream yields the transparency tests' GPT samples in the order their map-style reference
trains on them (`global_indices` of step 0, 1, ...), each tagged with its stream position "id", so
the losses can be compared with plain training and every sample traced. Batches come from
`engine.batches(stream, stop=STEPS)` (one step read ahead). Rank 2 (or rank 0 when the job is
smaller) sends itself SIGUSR1 during step SIGNAL_AT - 1, so the job checkpoints after it and morphs.
After each step it trained, every rank appends {"step", "shape", "stage", "replica", "ids"} to
OUT/ids-rank<r>-<shape>.jsonl; rank 0 appends the loss to OUT/losses.jsonl.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import GLOBAL_BATCH, MICRO_BATCH, build, dataset, optimizer  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.data import collate, global_indices  # noqa: E402


class ReferenceStream(torch.utils.data.IterableDataset):
    """The samples of the map-style reference's steps 0, 1, 2, ... as one endless stream."""

    def __init__(self) -> None:
        self.data = dataset("gpt")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        position = itertools.count()
        for step in itertools.count():
            for i in global_indices(step, GLOBAL_BATCH, len(self.data)):
                yield {**self.data[i], "id": torch.tensor(next(position))}


out, steps, signal_at = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
stream = ReferenceStream()
engine = Varuna(
    build("gpt"),
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=MICRO_BATCH,
    example_batch=collate([stream.data[i] for i in range(MICRO_BATCH)]),
)
engine.set_optimizer(optimizer(engine.parameters()))
shape = f"{engine.config.pipeline}x{engine.config.data}"
signaller = 2 if engine.world_size > 2 else 0
for step, batch in enumerate(engine.batches(stream, stop=steps), start=engine.step_count):
    ids = batch.pop("id").tolist()
    if step + 1 == signal_at and engine.rank == signaller:
        os.kill(os.getpid(), signal.SIGUSR1)  # arrives during this step; the morph follows it
    loss = engine.step(batch)
    record = {"step": step, "shape": shape, "stage": engine.stage, "replica": engine.replica, "ids": ids}
    with open(out / f"ids-rank{engine.rank}-{shape}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    if engine.rank == 0:
        with open(out / "losses.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "shape": shape}) + "\n")
