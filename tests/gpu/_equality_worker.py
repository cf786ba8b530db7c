"""GPU check: every schedule, GPT and BERT, trained at one P x D on the job's device.

    varuna run --pipeline P --data D tests/gpu/_equality_worker.py OUT STEPS [MODEL ...]
    EQUALITY_SCHEDULES=gpipe,1f1b ...   # only these schedules (default: every one)

The models, data, batch shape and optimizer are the transparency test's (tests/scripts/
transparency_common.py), so the run that proves equality on CPU is the same one proved here on
CUDA. Each rank saves OUT/{model}-{P}x{D}-{schedule}/rank{r}.pt: the step losses, its
parameters (on the CPU) and how many forwards it pulled ahead of a late gradient, which `run_gpu_checks.py` compares with plain training on one device.
TF32 is off: a pipeline must not be blamed for the reduced-precision matmul's error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from transparency_common import GLOBAL_BATCH, MICRO_BATCH, MODELS, build, dataset, optimizer  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.data import collate  # noqa: E402
from varuna.schedule import SCHEDULES  # noqa: E402


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    kinds = sys.argv[3:] or list(MODELS)
    P, D = int(os.environ["VARUNA_PIPELINE"]), int(os.environ["VARUNA_DATA"])
    only = os.environ.get("EQUALITY_SCHEDULES")
    for kind in kinds:
        for schedule in only.split(",") if only else SCHEDULES:
            data = dataset(kind)
            folder = out / f"{kind}-{P}x{D}-{schedule}"
            folder.mkdir(parents=True, exist_ok=True)
            engine = Varuna(
                build(kind),
                pipeline=P,
                data=D,
                schedule=schedule,
                global_batch_size=GLOBAL_BATCH,
                micro_batch_size=MICRO_BATCH,
                example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
            )
            engine.set_optimizer(optimizer(engine.parameters()))
            losses, pulled = [], 0
            for k in range(steps):
                losses.append(engine.step(engine.batch(data, k)))
                pulled += engine.last_times.pulled_ahead if engine.last_times else 0
            params = {n: p.detach().cpu().clone() for n, p in engine.named_parameters()}
            torch.save(
                {
                    "losses": losses,
                    "params": params,
                    "device": str(engine.device),
                    "pulled_ahead": pulled,
                    "refit": engine.refit_info,  # zb-h1, zb-v: steps after the 2nd in the refitted order
                },
                folder / f"rank{engine.rank}.pt",
            )
            engine.close()


if __name__ == "__main__":
    main()
