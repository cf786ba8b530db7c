"""A GPT whose block 3 (on stage 1 at partition=[1]) turns inf in step 1, in fp32 and in bf16:
every rank raises the same NonFiniteError naming stage 1. Writes OUT/<precision>-rank<r>.txt.

    varuna run --pipeline 2 tests/scripts/nonfinite_train.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import dataset  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.data import collate  # noqa: E402
from varuna.engine.nonfinite import NonFiniteError  # noqa: E402
from varuna.models import GPT, gpt_tiny  # noqa: E402


class Poison(torch.nn.Module):
    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block, self.on = block, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out * float("inf") if self.on else out


out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for precision in ("fp32", "bf16"):
    torch.manual_seed(0)
    model = GPT(gpt_tiny())
    model.blocks[3] = Poison(model.blocks[3])
    data = dataset("gpt")
    engine = Varuna(
        model,
        global_batch_size=8,
        micro_batch_size=2,
        partition=[1],
        precision=precision,
        example_batch=collate([data[0], data[1]]),
    )
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    engine.step(engine.batch(data, 0))
    model.blocks[3].on = True
    try:
        engine.step(engine.batch(data, 1))
        message = "no error"
    except NonFiniteError as exc:
        message = str(exc)
    (out / f"{precision}-rank{engine.rank}.txt").write_text(message)
    engine.close()
