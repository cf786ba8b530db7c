"""comm test helper (2 ranks): activations sent to the receives posted early with their shape.

Rank 1 (first stage) sends 3 micro-batches per "step" for 5 steps; micro-batch 1 changes shape at
step 3 and back at step 4 (with its batch), micro-batch 2 is a tuple with an int64 tensor. Rank 0
checks every value and gradient round trip and prints, per run (gloo without and with the watcher
threads, posting in send order as for NCCL, and without `begin_step` as the profiler uses it), how
many activations came in early receives and how many headers rank 1 sent, as one JSON line.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from varuna.comm.p2p import P2P

STEPS, MICRO = 5, 3


def rows(step: int, mb: int) -> int:
    return 5 if (mb == 1 and step == 3) else 3


def batch(step: int) -> list[dict[str, torch.Tensor]]:
    """The step's micro-batches as the runtime hands them to `begin_step`."""
    return [{"ids": torch.zeros(rows(step, mb), dtype=torch.int64)} for mb in range(MICRO)]


def value(step: int, mb: int) -> torch.Tensor | tuple[torch.Tensor, ...]:
    rows_ = rows(step, mb)
    x = torch.arange(rows_ * 4, dtype=torch.float32).reshape(rows_, 4) + 100 * step + mb
    if mb == 2:
        return (x, torch.arange(6, dtype=torch.int64) * step)
    return x


def run(rank: int, ordered: bool, stepped: bool) -> dict[str, object]:
    device = torch.device("cpu")
    wrong: list[str] = []
    if rank == 1:
        p2p = P2P(None, 0, device, ordered=ordered)
        for step in range(STEPS):
            if stepped:
                p2p.begin_step(batch(step))
            dist.barrier()
            for mb in range(MICRO):
                p2p.send_activation(mb, value(step, mb))
            for mb in range(MICRO):
                first = value(step, mb)
                first = first[0] if isinstance(first, tuple) else first
                if not torch.equal(p2p.recv_grad(mb)[0], 2 * first):
                    wrong.append(f"grad step {step} mb {mb}")
            p2p.finish()
    else:
        p2p = P2P(1, None, device, ordered=ordered)
        for step in range(STEPS):
            if stepped:
                p2p.begin_step(batch(step))  # as the runtime does at the start of a step
            else:
                for mb in range(MICRO):
                    p2p.post_activation_header(mb)
            dist.barrier()
            for mb in range(MICRO):
                got, want = p2p.recv_activation(mb), value(step, mb)
                pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
                if not all(torch.equal(g.detach(), w) for g, w in pairs):
                    wrong.append(f"value step {step} mb {mb}")
                first = got[0] if isinstance(got, tuple) else got
                first.grad = 2 * first.detach()
                p2p.send_grad(mb, got)
            p2p.finish()
    p2p.close()
    return {"early": p2p.early_received, "headers": p2p.headers_sent, "wrong": wrong}


def main() -> None:
    rank = dist.get_rank()
    seen = {}
    # ordered: NCCL's way, one micro-batch ahead; unstepped: a header with every activation
    for mode in ("watch=0", "watch=1", "ordered", "unstepped", "unstepped-watch=1"):
        os.environ["VARUNA_P2P_WATCH"] = "1" if mode.endswith("watch=1") else "0"
        seen[mode] = run(rank, ordered=mode == "ordered", stepped=not mode.startswith("unstepped"))
        dist.barrier()
    print("EARLY " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
