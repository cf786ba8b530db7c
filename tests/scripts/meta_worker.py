"""Trains transformers models built on the meta device through the real engine (`varuna run`).

    varuna run --pipeline W tests/scripts/meta_worker.py OUT W WEIGHTS_ROOT

For each P x D of hf_common.CONFIGS[W] (a world-4 job serves 2x2 and 4x1): Llama (rotary
`inv_freq`, a non-persistent buffer) and GPT-2 (tied embeddings), built under
`torch.device("meta")`, loaded with `weights=` from WEIGHTS_ROOT/<kind> (a sharded folder written
by `save_pretrained`) under two schedules; at 2x1 and 4x1 also without weights (the seeded init),
recording each rank's parameters before the first step. World 2 also asks for pipeline="auto" (refused:
a meta model cannot be profiled). OUT/<tag>/rank<r>.pt holds the losses, the
parameters before and after, and the rank's stage; the 4x1 Llama under 1F1B also checkpoints.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from hf_common import CONFIGS, GLOBAL_BATCH, MICRO_BATCH, STEPS, Data, build, optimizer  # noqa: E402

from varuna import Varuna, auto_cut  # noqa: E402
from varuna.data import collate  # noqa: E402
from varuna.errors import PlanError  # noqa: E402

META_MODELS = ("llama", "gpt2")
META_SCHEDULES = ("1f1b", "varuna")


def train(where: Path, kind: str, P: int, D: int, schedule: str, weights: Path | None) -> None:
    with torch.device("meta"):
        model = build(kind)
    auto_cut(model)
    data = Data(kind)
    engine = Varuna(
        model,
        pipeline=P,
        data=D,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        schedule=schedule,
        example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
        weights=weights,
    )
    assert not any(t.is_meta for _, t in engine.named_parameters())
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    engine.set_optimizer(optimizer(engine.parameters()))
    losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
    record: dict[str, Any] = {
        "losses": losses,
        "before": before,
        "params": {n: p.detach().clone() for n, p in engine.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta},
        "stage": engine.stage,
    }
    where.mkdir(parents=True, exist_ok=True)
    torch.save(record, where / f"rank{engine.rank}.pt")
    if where.name == "llama-4x1-1f1b":  # for varuna consolidate -> shards -> from_pretrained
        engine.checkpoint(where / "checkpoints")
    engine.close()


if __name__ == "__main__":
    out, world, weights_root = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    for P, D in CONFIGS[world]:
        for kind in META_MODELS:
            for schedule in META_SCHEDULES:
                train(out / f"{kind}-{P}x{D}-{schedule}", kind, P, D, schedule, weights_root / kind)
            if D == 1:
                train(out / f"{kind}-{P}x{D}-init", kind, P, D, "1f1b", None)
    if world == 2:  # pipeline="auto" cannot profile a meta model: the same typed error on every rank
        with torch.device("meta"):
            model = build("llama")
        auto_cut(model)
        data = Data("llama")
        try:
            Varuna(
                model,
                global_batch_size=GLOBAL_BATCH,
                pipeline="auto",
                example_batch=collate([data[0], data[1]]),
            )
        except PlanError as exc:
            (out / f"auto-error-rank{os.environ.get('PMI_RANK', '0')}.txt").write_text(str(exc))
