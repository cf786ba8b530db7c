"""Two ranks under VARUNA_NCCL_RULES=1: what NCCL would do, shown on gloo (test_comm_jobs).

    VARUNA_NCCL_RULES=1 varuna run --pipeline 2 tests/scripts/nccl_rules_check.py

Prints "RULES {json}" per rank with three cases:
- shared: both directions on one group; rank 1 posts a receive for a second activation before it
  sends the gradient rank 0 waits for (as an early receive does): NCCL would hang, the rules raise.
- split: the same on two groups (`varuna.comm.links`): it completes.
- order: rank 0 sends A (tag 1) then B (tag 2); rank 1 posts B's receive first: with tags ignored
  it gets A's values (gloo alone would match by tag).
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from varuna.comm import nccl_rules
from varuna.comm.rendezvous import init_distributed

rank, _ = init_distributed()
out: dict[str, object] = {"installed": nccl_rules.installed()}
act, grad = dist.new_group([0, 1]), dist.new_group([0, 1])
first = dist.new_group([0, 1])


def exchange(a_group: object, g_group: object) -> str:
    """rank 0: send act 0, receive its gradient, then send act 1; rank 1: receive act 0, post act
    1's receive early, send the gradient."""
    x = torch.zeros(4)
    try:
        if rank == 0:
            dist.isend(torch.ones(4), 1, group=a_group, tag=1).wait()
            dist.irecv(x, 1, group=g_group, tag=2).wait()
            dist.isend(torch.full((4,), 2.0), 1, group=a_group, tag=3).wait()
        else:
            dist.irecv(x, 0, group=a_group, tag=1).wait()
            early = dist.irecv(torch.zeros(4), 0, group=a_group, tag=3)
            dist.isend(x * 3, 0, group=g_group, tag=2).wait()
            early.wait()
    except nccl_rules.NcclRuleError as exc:
        return f"NcclRuleError: {exc}"
    return "completed"


out["split"] = exchange(act, grad)
out["shared"] = exchange(first, first)
order = dist.new_group([0, 1])
got = torch.zeros(3)
if rank == 0:
    sends = [dist.isend(torch.full((3,), v), 1, group=order, tag=t) for v, t in ((1.0, 1), (2.0, 2))]
    for w in sends:
        w.wait()
else:
    recvs = [dist.irecv(got, 0, group=order, tag=2), dist.irecv(torch.zeros(3), 0, group=order, tag=1)]
    for w in recvs:
        w.wait()
out["order_b_got"] = got.tolist()
print("RULES " + json.dumps(out), flush=True)
