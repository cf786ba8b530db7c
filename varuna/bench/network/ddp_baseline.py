"""PyTorch's data parallelism, the network bench's reference: `DistributedDataParallel` over every rank.

Each rank holds the whole GPT and trains on its replica's share of the global batch in the same
micro-batches as Varuna's replicas, accumulating gradients under `no_sync()` for all but the last
micro-batch, whose backward runs DDP's bucketed all-reduce (gloo here) overlapped with the rest of
that backward; then the same AdamW step. This is what a user of plain PyTorch would run at 1 x D.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

from varuna.bench.common import LR, build_model

__all__ = ["DDPRunner"]


class DDPRunner:
    """DDP over the default process group (every rank a replica); `step(batch)` takes the global batch
    and returns this replica's mean loss."""

    def __init__(self, spec: dict[str, Any], *, bucket_mb: float = 25.0) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.rank, self.replicas = dist.get_rank(), dist.get_world_size()
        B, self.mbs = spec["global_batch_size"], spec["micro_batch_size"]
        self.share = B // self.replicas
        self.M = self.share // self.mbs
        if self.share % self.mbs or self.M < 1:
            raise ValueError(
                f"DDP over {self.replicas} ranks: global batch {B} / {self.replicas} = {B / self.replicas:g} "
                f"samples per replica is not a multiple of micro_batch_size {self.mbs}"
            )
        self.model = DistributedDataParallel(build_model(spec["model"]), bucket_cap_mb=bucket_mb)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, batch: dict[str, Tensor]) -> float:
        self.opt.zero_grad(set_to_none=True)
        mine = {k: v[self.rank * self.share : (self.rank + 1) * self.share] for k, v in batch.items()}
        total = 0.0
        for m in range(self.M):
            micro = {k: v[m * self.mbs : (m + 1) * self.mbs] for k, v in mine.items()}
            last = m == self.M - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = self.model(**micro) / self.M
                loss.backward()
            total += float(loss.detach())
        self.opt.step()
        return total
