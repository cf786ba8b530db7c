"""Two ranks under VARUNA_NCCL_RULES=1: what NCCL would do, shown on gloo (test_comm_jobs).

    VARUNA_NCCL_RULES=1 varuna run --pipeline 2 tests/scripts/nccl_rules_check.py
    RULES_CASES=batched,split VARUNA_NCCL_RULES=strict varuna run ...   # these cases, in this order

Prints "RULES {json}" per rank with six cases:
- shared: both directions on one group; rank 1 posts a receive for a second activation before it
  sends the gradient rank 0 waits for (as an early receive does): NCCL would hang, the rules raise.
- split: the same on two groups (`varuna.comm.groups`): it completes.
- order: rank 0 sends A (tag 1) then B (tag 2); rank 1 posts B's receive first: with tags ignored
  it gets A's values (gloo alone would match by tag).
- created: each rank's first operation is a receive on a group the other starts with a send on the
  other group (as an early gradient receive was): NCCL's creation would hang, the rules raise.
- warmed: the same on groups made by `varuna.comm.groups.warm` first: it completes.
- batched: on one group, each rank's receive, then its send, posted as one batch
  (`batch_isend_irecv`): a batch's operations proceed together, so it completes where the same
  two posted one by one would hold each other back.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from varuna.comm import nccl_rules
from varuna.comm.groups import warm
from varuna.comm.rendezvous import init_distributed

rank, _ = init_distributed()
out: dict[str, object] = {"installed": nccl_rules.installed()}
# every group up front, in one order on every rank (whichever cases run)
act, grad, first, order = (dist.new_group([0, 1]) for _ in range(4))
made = [dist.new_group([0, 1]) for _ in range(4)]
one = dist.new_group([0, 1])


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


def ordered() -> list[float]:
    """rank 0 sends A (tag 1) then B (tag 2); rank 1 posts B's receive first: what it got."""
    got = torch.zeros(3)
    if rank == 0:
        sends = [dist.isend(torch.full((3,), v), 1, group=order, tag=t) for v, t in ((1.0, 1), (2.0, 2))]
        for w in sends:
            w.wait()
    else:
        recvs = [dist.irecv(got, 0, group=order, tag=2), dist.irecv(torch.zeros(3), 0, group=order, tag=1)]
        for w in recvs:
            w.wait()
    return got.tolist()


def crossed(one: object, other: object) -> str:
    """rank 0 receives on `one`, then sends on `other`; rank 1 receives on `other`, then sends on
    `one`: each rank's first operation is on the group the peer starts last."""
    mine, theirs = (one, other) if rank == 0 else (other, one)
    try:
        got = dist.irecv(torch.zeros(2), 1 - rank, group=mine)
        dist.isend(torch.full((2,), float(rank)), 1 - rank, group=theirs).wait()
        got.wait()
    except nccl_rules.NcclRuleError as exc:
        return f"NcclRuleError: {exc}"
    return "completed"


def warmed() -> str:
    warm([(made[2], 0, 1), (made[3], 0, 1)], rank, torch.device("cpu"))
    return crossed(made[2], made[3])


def batched() -> list[float] | str:
    warm([(one, 0, 1)], rank, torch.device("cpu"))
    back = torch.zeros(2)
    ops = [
        dist.P2POp(dist.irecv, back, 1 - rank, one),
        dist.P2POp(dist.isend, torch.full((2,), rank + 5.0), 1 - rank, one),
    ]
    try:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    except nccl_rules.NcclRuleError as exc:
        return f"NcclRuleError: {exc}"
    return back.tolist()


CASES = {
    "split": lambda: exchange(act, grad),
    "shared": lambda: exchange(first, first),
    "order_b_got": ordered,
    "created": lambda: crossed(made[0], made[1]),
    "warmed": warmed,
    "batched": batched,
}
for name in os.environ.get("RULES_CASES", ",".join(CASES)).split(","):
    out[name] = CASES[name]()
print("RULES " + json.dumps(out), flush=True)
