"""comm test helper (2 ranks): a cut whose shape changes while its batch's shapes do not.

Rank 1 (first stage) sends 2 micro-batches per step for 3 steps, every batch of the same shape;
micro-batch 1's value grows from 3 to 4 rows at step 2. Without headers on every activation the
sender stops with PartitionError; with VARUNA_P2P_HEADERS=every rank 0 checks every value and prints
one JSON line. MISMATCH_LINK=serial: the same over `varuna.comm.serial` (NCCL's links), its shape
probe run as the runtime runs it.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from varuna.comm.p2p import P2P
from varuna.comm.serial import Courier, SerialLink, replica_group

STEPS, MICRO = 3, 2


def value(step: int, mb: int) -> torch.Tensor:
    rows = 4 if (mb == 1 and step == 2) else 3
    return torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 10 * step + mb


def main() -> None:
    rank, device = dist.get_rank(), torch.device("cpu")
    micro = [{"ids": torch.zeros(2, 8, dtype=torch.int64)} for _ in range(MICRO)]  # never changes
    wrong, received = [], 0
    p2p: P2P | SerialLink
    if os.environ.get("MISMATCH_LINK") == "serial":
        courier = Courier(replica_group(2, 1, 0, device), device)
        p2p = (
            SerialLink(None, 0, device, courier, 0) if rank == 1 else SerialLink(1, None, device, courier, 1)
        )
    else:
        p2p = P2P(None, 0, device) if rank == 1 else P2P(1, None, device)
    for step in range(STEPS):
        micro = [dict(b) for b in micro]  # a new step's list, as the engine makes one
        p2p.begin_step(micro)
        for mb in p2p.shape_probe():  # serial links: the probe, as the runtime sends it
            if rank == 1:
                p2p.probe_send(mb, value(step, mb))
            else:
                p2p.probe_recv(mb)
        for mb in range(MICRO):
            if rank == 1:
                p2p.send_activation(mb, value(step, mb))
                p2p.recv_grad(mb)
            else:
                got = p2p.recv_activation(mb)
                received += 1
                if not torch.equal(got.detach(), value(step, mb)):
                    wrong.append(f"step {step} mb {mb}")
                got.grad = torch.ones_like(got)
                p2p.send_grad(mb, got)
        p2p.finish()
    p2p.close()
    if rank == 0:
        print("MISMATCH " + json.dumps({"wrong": wrong, "received": received}), flush=True)


if __name__ == "__main__":
    main()
