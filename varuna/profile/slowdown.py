"""How much slower a rank computes while n ranks compute at once (`measure_slowdown`).

On a CPU host with fewer cores than ranks this is about n / cores; the planner reads it as
`CostTable.compute_slowdown` (see `varuna.planner.sharing`). `varuna.profile.measure` re-exports it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from varuna.comm.rendezvous import host_layout
from varuna.cut.cutpoint import model_loss
from varuna.profile.passes import device_of, micro_batch, preserved

__all__ = ["measure_slowdown", "at_least_time_sharing"]


def measure_slowdown(
    model: nn.Module,
    example_batch: Mapping[str, Any],
    *,
    micro_batch_size: int = 1,
    repeats: int = 3,
    rounds: int | None = None,
) -> dict[int, float]:
    """Collective: n -> a rank's forward+backward time while ranks 0..n-1 all run it, over the
    time with rank 0 running it alone, for n = 1 .. world size. Every rank returns the same table.

    Each rank runs its own copy of `model` on a micro-batch of `micro_batch_size` rows. The n busy
    ranks run passes back to back until a common deadline, so every timed pass overlaps all n-1
    others for its whole length; a pass still running at the deadline (when the others may have
    stopped) is not counted. Every count gets the same window, `repeats` x world lone passes: the
    lone time, which every factor of a round divides by, is then measured over as many passes as
    the busiest count's (with a window of `repeats` x n passes it had `repeats` passes, and one
    slow pass moved every factor of the round). Running for a fixed number of passes instead lets
    the first rank done hand its core to the rest, which reads sharing as cheaper than it is. A
    rank's time is the mean of its passes (time-slicing makes some passes much longer than the
    typical one, and the median, which skips them, reads sharing as cheaper than the n / cores it
    cannot be under); n ranks' time is the one of their mean rate, the harmonic mean. The host's
    speed drifts over seconds, so the counts 1..world are measured in `rounds` interleaved rounds
    and each round's factors are over that round's lone time; the table holds the median factor of
    the rounds. `rounds` None: five on CPU (two disturbed rounds cannot move the median; ranks
    sharing a host's cores are what this measures there), three on CUDA (a rank per device: every
    factor near 1, and a round costs world^2 x `repeats` lone passes). Gradients and RNG state are
    left as they were.

    Where ranks 0..n-1 share one host of c < n cores, the factor is at least n / c times the
    factor at c: each rank gets at most c / n of a core on average. A measured factor can fall
    below that bound, as ranks leave the barrier at different times and start their first passes
    with fewer others; the bound replaces it then.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    device = device_of(model)
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    )
    micro = micro_batch(example_batch, micro_batch_size, device)
    if rounds is None:
        rounds = 3 if device.type == "cuda" else 5

    def one_pass() -> float:
        sync()
        t0 = time.perf_counter()
        model_loss(model(**micro)).backward()
        sync()
        return time.perf_counter() - t0

    factors: dict[int, list[float]] = {n: [] for n in range(1, world + 1)}
    with preserved(model):
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        one_pass()  # warm-up on every rank
        box = [statistics.median(one_pass() for _ in range(3)) if rank == 0 else 0.0]
        dist.broadcast_object_list(box, src=0)
        lone = float(box[0])
        for _ in range(rounds):
            per_n: list[float] = []
            for n in range(1, world + 1):
                dist.barrier()
                mine = float("nan")
                if rank < n:
                    deadline = time.perf_counter() + max(repeats, 1) * world * lone
                    times = []
                    while True:
                        t = one_pass()
                        if time.perf_counter() > deadline:
                            break
                        times.append(t)
                    mine = statistics.fmean(times) if times else t
                every: list[Any] = [None] * world
                dist.all_gather_object(every, mine)
                per_n.append(n / sum(1.0 / x for x in every[:n]))  # the n ranks' mean rate
            for n in range(1, world + 1):
                factors[n].append(per_n[n - 1] / per_n[0])
    table = {n: statistics.median(f) for n, f in factors.items()}
    return at_least_time_sharing(table, host_layout())


def at_least_time_sharing(table: dict[int, float], hosts: list[tuple[str, int]]) -> dict[int, float]:
    """`table` with each n > c, for ranks 0..n-1 on one host of c cores, raised to n / c x table[c]
    (`hosts`: every rank's (host, cores), as `host_layout` gives; `measure_slowdown` applies it)."""
    host, cores = hosts[0]
    out = dict(table)
    for n in table:
        if cores < n and cores in table and all(h == host for h, _ in hosts[:n]):
            out[n] = max(table[n], n / cores * table[cores])
    return out
