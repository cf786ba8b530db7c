"""A 2-stage training script started by torchrun, for tests/multirank/test_packaging_jobs.py.

    torchrun --standalone --nproc-per-node 2 tests/scripts/torchrun_train.py OUT

The ranks meet through torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the agent
hosts the store), never through MPI: mpi4py is made unimportable first, as in an install without the
`varuna[mpi]` extra. Trains a tiny GPT at P = 2 for two steps; every rank writes OUT/rank<r>.json with
its stage, the world and its losses, and rank 0 adds the losses of the same two steps of plain training.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

sys.modules["mpi4py"] = None  # type: ignore[assignment]  # `import mpi4py` raises ImportError from here on

import torch  # noqa: E402

import varuna  # noqa: E402
from varuna.comm.rendezvous import shutdown  # noqa: E402
from varuna.data import ReplicaLoader, SyntheticLM, collate  # noqa: E402
from varuna.models import GPT, gpt_tiny  # noqa: E402

out = Path(sys.argv[1])
torch.manual_seed(0)  # the same initial weights on every rank
cfg = gpt_tiny()
model = GPT(cfg)
plain = copy.deepcopy(model)
dataset = SyntheticLM(cfg.vocab_size, cfg.seq_len, size=64)
engine = varuna.Varuna(
    model,
    pipeline=2,
    global_batch_size=8,
    micro_batch_size=2,
    example_batch=collate([dataset[0], dataset[1]]),
)
engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
losses = [engine.step(engine.batch(dataset, step)) for step in range(2)]
record = {
    "rank": engine.rank,
    "world": torch.distributed.get_world_size(),
    "stage": engine.stage,
    "losses": losses,
    "mpi4py_loaded": sys.modules.get("mpi4py") is not None,
}
if engine.rank == 0:
    optim = torch.optim.SGD(plain.parameters(), lr=0.1)
    loader = ReplicaLoader(dataset, global_batch_size=8, replica=0, data_parallel=1)
    record["plain"] = []
    for step in range(2):
        optim.zero_grad()
        loss = plain(**loader.batch(step))
        loss.backward()
        optim.step()
        record["plain"].append(loss.item())
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{engine.rank}.json").write_text(json.dumps(record))
engine.close()
shutdown()  # torchrun has no teardown of its own: the default group goes here
