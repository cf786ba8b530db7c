"""The process groups a pipeline's stage boundaries talk on: one for activations, one for gradients.

NCCL runs one communicator's operations one after another on its stream. Were a boundary's two
directions on one communicator, the receives a stage posts early for the next activations would
hold back its gradient sends, while the stage before waits for those gradients before it sends the
activations: both ranks wait forever (gloo, whose operations proceed independently, does not;
`varuna.comm.nccl_rules` reproduces NCCL's behaviour on a CPU). So each boundary between two ranks
gets two groups of those two ranks, one per direction; with two chunks per rank each virtual
boundary has its own, so the chunks' messages never share a stream.

NCCL also creates a pair's communicator on the first send or receive on it, and that creation
blocks until the peer makes its own first call there. A stage whose first operation is an early
gradient receive on one group, while its peer's first is an activation receive on the other, would
wait forever in creation. So the groups are warmed once, right after they are made: every rank
exchanges one element on each of its groups in the order the groups were created, which is the same
on every rank, so no two ranks can wait on each other (the group first in that order with a rank
waiting has both its ranks there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from varuna.comm.p2p import P2P
from varuna.comm.rendezvous import group_timeout

__all__ = ["boundary_groups", "pair_link", "warm"]


def boundary_groups(
    pipeline: int,
    data: int,
    num_stages: int,
    rank_of: Callable[[int], int],
    *,
    position: int,
    replica: int,
    device: torch.device,
) -> dict[int, tuple[Any, Any]]:
    """Create every boundary's (activations, gradients) groups, in one order on every rank (as
    torch.distributed requires), and return this rank's: boundary v (between virtual stages v and
    v + 1) -> its two groups, for the boundaries of its own pipeline that it sits on. A boundary
    inside one rank (two of its chunks meeting) is a local hand-off and gets none. `device` is this
    rank's (the warm-up's element lives there, as NCCL requires)."""
    mine: dict[int, tuple[Any, Any]] = {}
    made: list[tuple[Any, int, int]] = []
    for r in range(data):
        for v in range(num_stages - 1):
            a, b = rank_of(v), rank_of(v + 1)
            if a == b:
                continue
            ranks = sorted((r * pipeline + a, r * pipeline + b))
            act = dist.new_group(ranks, timeout=group_timeout())
            grad = dist.new_group(ranks, timeout=group_timeout())
            made += [(act, ranks[0], ranks[1]), (grad, ranks[0], ranks[1])]
            if r == replica and position in (a, b):
                mine[v] = (act, grad)
    warm(made, dist.get_rank(), device)
    return mine


def warm(
    groups: list[tuple[Any, int, int]], rank: int, device: torch.device, *, batched: bool = False
) -> None:
    """Make the point-to-point communicator of each (group, lower rank, higher rank) this rank is
    in, in the given order (the same on every rank): the lower rank sends one element, the higher
    receives it. On NCCL this is where each pair's communicator is created (each exchange finished
    on the device before the next creation: NCCL warns that a CUDA call made while its kernels
    run may wait for them); on gloo it costs a round trip per group. `batched`: as a
    `batch_isend_irecv` (which NCCL runs on the group's own communicator, `varuna.comm.serial`),
    not an unbatched send (a pair's own two-rank communicator)."""
    one = torch.zeros(1, device=device)
    for group, low, high in groups:
        if rank in (low, high):
            op, peer = (dist.isend, high) if rank == low else (dist.irecv, low)
            works = (
                dist.batch_isend_irecv([dist.P2POp(op, one, peer, group)])
                if batched
                else [op(one, peer, group=group)]
            )
            for work in works:
                assert work is not None  # this rank is in the group
                work.wait()
            if device.type == "cuda":  # no NCCL kernel in flight while the next communicator is made
                torch.cuda.synchronize(device)


def pair_link(rank: int, device: torch.device, *, ordered: bool | None = None) -> P2P | None:
    """The link between ranks 0 (a first stage) and 1 (its next), made as the engine makes one, for
    measurements and checks outside a pipeline; None on the other ranks. Every rank of the job must
    call it (it creates the two groups)."""
    groups = boundary_groups(2, 1, 2, lambda v: v, position=rank, replica=0, device=device)
    if rank == 0:
        return P2P(None, 1, device, ordered=ordered, down=groups[0])
    if rank == 1:
        return P2P(0, None, device, ordered=ordered, up=groups[0])
    return None
