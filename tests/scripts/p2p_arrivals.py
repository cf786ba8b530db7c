"""comm test helper (2 ranks): the receiver learns of an arrival without blocking on it.

Rank 1 sends micro-batch 0's activation 0.3 s late; rank 0 polls `activation_ready` (never
waiting) until it turns True, then receives; then the same for the gradient going back. Rank 0
prints what it saw as one JSON line.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from varuna.comm.p2p import P2P


def _poll(ready, timeout_s: float = 10.0) -> float | None:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if ready():
            return time.perf_counter() - t0
        time.sleep(0.002)
    return None


def main() -> None:
    rank, device = dist.get_rank(), torch.device("cpu")
    value = torch.arange(12.0).reshape(3, 4)
    if rank == 1:  # the first stage: sends the activation, receives its gradient
        p2p = P2P(None, 0, device)
        dist.barrier()
        time.sleep(0.3)
        p2p.send_activation(0, value)
        seen = {"grad_ready_at_once": p2p.grad_ready(0), "grad_after_s": _poll(lambda: p2p.grad_ready(0))}
        seen["grad"] = p2p.recv_grad(0)[0].tolist()
        p2p.finish()
    else:  # the second stage: receives the activation, sends its gradient back
        p2p = P2P(1, None, device)
        p2p.post_activation_header(0)
        dist.barrier()
        seen = {"ready_at_once": p2p.activation_ready(0)}
        seen["after_s"] = _poll(lambda: p2p.activation_ready(0))
        received = p2p.recv_activation(0)
        seen["value"] = received.detach().tolist()
        time.sleep(0.3)
        received.grad = 2 * received.detach()
        p2p.send_grad(0, received)
        p2p.finish()
    p2p.close()
    dist.barrier()
    print("ARRIVALS " + json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
