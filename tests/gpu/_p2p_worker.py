"""GPU check, 2 ranks: `varuna.comm.p2p` on the job's own transport (NCCL on CUDA, gloo on CPU).

    varuna run --pipeline 2 tests/gpu/_p2p_worker.py OUT

Rank 0 is the first stage, rank 1 the second. Two parts, each rank writing OUT/p2p-rank{r}.json:

- ordering: 5 steps x 4 micro-batches in the runtime's order (every header posted at the start of
  the step, then activations one way and gradients back). Micro-batch 1 changes shape at step 3 and
  back at step 4, micro-batch 2 is a tuple with an int64 tensor, micro-batch 3 is 4 MiB (NCCL
  moves it in several chunks). NCCL ignores tags and pairs sends with receives in posting order, so
  this is where a wrongly ordered post would deliver one micro-batch's tensor into another's buffer;
  every value and gradient is compared exactly, and the early-receive count shows the receives
  posted with last step's shapes were used. On gloo (tags) it runs a second time in NCCL's
  posting order (`ordered=True`), so the CPU run covers that path too.
- arrival: the sender sends 0.3 s late; the receiver polls `activation_ready` (never waiting) and
  must see it turn True only then; the same for the gradient. Pull-ahead relies on this; on NCCL
  the work's `is_completed()` answers, on gloo the watcher threads (VARUNA_P2P_WATCH=1) do.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from varuna.comm.groups import pair_link
from varuna.comm.p2p import P2P

STEPS, MICRO = 5, 4
BIG_ROWS = 256  # micro-batch 3: 256 x 4096 float32 = 4 MiB


def _device() -> torch.device:
    """The engine's device seam, restated: NCCL's ranks compute on their CUDA device."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def value(step: int, mb: int, device: torch.device) -> torch.Tensor | tuple[torch.Tensor, ...]:
    if mb == 3:
        return (
            torch.arange(BIG_ROWS * 4096, dtype=torch.float32, device=device).reshape(BIG_ROWS, 4096) + step
        )
    rows = 5 if (mb == 1 and step == 3) else 3
    x = torch.arange(rows * 4, dtype=torch.float32, device=device).reshape(rows, 4) + 100 * step + mb
    if mb == 2:
        return (x, torch.arange(6, dtype=torch.int64, device=device) * step)
    return x


def _first(v: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return v[0] if isinstance(v, tuple) else v


def _link(rank: int, device: torch.device, ordered: bool | None = None) -> P2P:
    link = pair_link(rank, device, ordered=ordered)  # the engine's: a group per direction
    assert link is not None
    return link


def ordering(rank: int, device: torch.device, ordered: bool | None) -> dict[str, object]:
    wrong: list[str] = []
    p2p = _link(rank, device, ordered=ordered)
    if rank == 0:
        for step in range(STEPS):
            dist.barrier()
            for mb in range(MICRO):
                p2p.send_activation(mb, value(step, mb, device))
            for mb in range(MICRO):
                if not torch.equal(p2p.recv_grad(mb)[0], 2 * _first(value(step, mb, device))):
                    wrong.append(f"grad step {step} mb {mb}")
            p2p.finish()
    else:
        for step in range(STEPS):
            for mb in range(MICRO):
                p2p.post_activation_header(mb)  # as the runtime does at the start of a step
            dist.barrier()
            for mb in range(MICRO):
                got, want = p2p.recv_activation(mb), value(step, mb, device)
                pairs = zip(got, want) if isinstance(want, tuple) else [(got, want)]
                if not all(torch.equal(g.detach(), w) for g, w in pairs):  # type: ignore[union-attr]
                    wrong.append(f"value step {step} mb {mb}")
                first = _first(got)
                first.grad = 2 * first.detach()
                p2p.send_grad(mb, got)
            p2p.finish()
    p2p.close()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"early": p2p.early_received, "wrong": wrong, "ordered": p2p.ordered}


def _poll(ready, timeout_s: float = 10.0) -> float | None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if ready():
            return time.perf_counter() - t0
        time.sleep(0.002)
    return None


def arrival(rank: int, device: torch.device) -> dict[str, object]:
    os.environ["VARUNA_P2P_WATCH"] = "1"  # gloo needs the watcher threads; NCCL ignores it
    want = torch.arange(12.0, device=device).reshape(3, 4)
    p2p = _link(rank, device)
    if rank == 0:
        dist.barrier()
        time.sleep(0.3)
        p2p.send_activation(0, want)
        seen: dict[str, object] = {"ready_at_once": p2p.grad_ready(0)}
        seen["after_s"] = _poll(lambda: p2p.grad_ready(0))
        seen["exact"] = torch.equal(p2p.recv_grad(0)[0], 2 * want)
    else:
        p2p.post_activation_header(0)
        dist.barrier()
        seen = {"ready_at_once": p2p.activation_ready(0)}
        seen["after_s"] = _poll(lambda: p2p.activation_ready(0))
        got = p2p.recv_activation(0)
        assert isinstance(got, torch.Tensor)
        seen["exact"] = torch.equal(got.detach(), want)
        time.sleep(0.3)
        got.grad = 2 * got.detach()
        p2p.send_grad(0, got)
    p2p.finish()
    p2p.close()
    return seen


def main() -> None:
    out = Path(sys.argv[1])
    rank, device = dist.get_rank(), _device()
    result: dict[str, object] = {"backend": dist.get_backend(), "device": str(device)}
    # the runtime's own mode (posting order on NCCL, tags on gloo); on gloo NCCL's way too
    result["ordering"] = {"runtime": ordering(rank, device, None)}
    dist.barrier()
    if device.type == "cpu":
        result["ordering"]["posting order"] = ordering(rank, device, True)  # type: ignore[index]
        dist.barrier()
    result["arrival"] = arrival(rank, device)
    dist.barrier()
    (out / f"p2p-rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
