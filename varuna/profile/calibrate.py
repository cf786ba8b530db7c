"""The runtime's own cost per action, for the planner: a short pipeline of exactly known compute.

The profile measures each segment's compute inside one whole pass of the model, and the network
with the runtime's transfer code between two ranks. A pipelined stage costs more than that: it
enters the model once per action (not once per pass), its messages keep the transport's threads
busy on a loaded host, and each step has bookkeeping of its own. A pipeline whose compute is a
spin loop of exactly known cost shows that work directly; without this term the planner predicts
every pipelined shape too short and 1 x D right (docs/benchmarks/planner.md has the figures).

`fit_action_overhead` runs the real engine on every rank of the job as one pipeline (P = world,
1F1B, 2P micro-batches of one row) whose stages spin for an exact CPU time each action: the
profiled model's forward and backward split evenly over the stages, so the host is as loaded as
in a real run. It then finds the seconds `c` that, added to every compute action of that same
pipeline in `varuna.planner.search.predict` (with the job's measured network and the host's cores shared
fairly), make the prediction equal the measured step. The planner adds `c` to every action of
every pipelined configuration (`CostTable.action_overhead_s`). docs/benchmarks/planner.md gives the
values it takes and what it does to the planner's error.

Only where ranks share cores (some host runs more of the job's ranks than it has cores, `shares_cores`).
Where each rank has a core of its own, a stage's actions took what the profile says of its segments
(the engine's spans against the profile's compute, the step against the prediction without any cost
per action: docs/benchmarks/planner.md, "own-core"); the spin pipeline's per-action loss stands for
work the profiled compute of a real model already holds, and charging it again priced such pipelines
long. There the result is 0 and no pipeline runs.

Collective: every rank calls it. CPU (gloo) only: on CUDA the compute runs on the devices and a
CPU spin would stand for nothing there, so the result is 0 (unmeasured).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from varuna._env import patched_environ
from varuna.comm.rendezvous import host_layout
from varuna.cut.cutpoint import CutPoint
from varuna.planner.costs import CostTable, SegmentCost
from varuna.planner.search import predict

__all__ = ["fit_action_overhead", "shares_cores"]

_SCRATCH = 2**14
"""Floats the spin loop works on between clock reads (64 KiB, in cache)."""


def _spin(seconds: float, scratch: torch.Tensor) -> None:
    """Keep this thread busy for `seconds` of its own CPU time (not wall time: a shared core
    stretches the wall time exactly as it stretches the real compute's)."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        scratch.mul_(1.0)


class _Spin(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float, scratch: torch.Tensor
    ) -> torch.Tensor:
        ctx.backward_s, ctx.scratch = backward_s, scratch
        _spin(forward_s, scratch)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        _spin(ctx.backward_s, ctx.scratch)
        return grad, None, None, None


class _Block(nn.Module):
    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.forward_s, self.backward_s = forward_s, backward_s
        self.register_buffer("scratch", torch.ones(_SCRATCH), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the parameter first: the first stage's input (the batch) needs no gradient, and a spin
        # on it alone would never run backward there
        return _Spin.apply(x * self.scale, self.forward_s, self.backward_s, self.scratch)


class _SpinModel(nn.Module):
    """`stages` blocks of exactly known compute, a CutPoint between each two."""

    def __init__(self, stages: int, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(forward_s, backward_s) for _ in range(stages))
        self.cuts = nn.ModuleList(CutPoint() for _ in range(stages - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i < len(self.cuts):
                x = self.cuts[i](x)
        return x.square().mean()


@contextlib.contextmanager
def _private_engine_env() -> Iterator[str]:
    """A scratch run directory, and no telemetry, resume or controller for the calibration's
    engine: it must not write into the job's run directory nor say hello to a workbench."""
    quiet = {"VARUNA_TELEMETRY": "0", "VARUNA_RESUME": None, "VARUNA_EVENTS": None, "VARUNA_COMMANDS": None}
    with patched_environ(quiet), tempfile.TemporaryDirectory(prefix="varuna-calibrate-") as scratch:
        yield scratch


def shares_cores(layout: Sequence[tuple[str, int]]) -> bool:
    """Whether some host runs more of the job's ranks than it has cores, given every rank's (host,
    cores it may run on) (`host_layout`): all of them busy stretch a spin (`_core_sharing`)."""
    return bool(layout) and _core_sharing(layout)[len(layout)] > 1.0


def _core_sharing(layout: Sequence[tuple[str, int]]) -> dict[int, float]:
    """n -> the factor by which n busy ranks of the job stretch a pure CPU spin, given every rank's
    (host, cores it may run on) (`host_layout`): each host's cores shared fairly among its share
    of the busy ranks."""
    world = len(layout)
    hosts: dict[str, list[int]] = {}
    for name, cores in layout:
        hosts.setdefault(name, []).append(cores)
    return {
        n: max(max(1.0, (n * len(ranks) / world) / max(max(ranks), 1)) for ranks in hosts.values())
        for n in range(1, world + 1)
    }


def _spin_table(
    table: CostTable, stages: int, forward_s: float, backward_s: float, nbytes: int, sharing: dict[int, float]
) -> CostTable:
    """The calibration pipeline as a profile: one segment per stage, the job's network."""
    segment = SegmentCost(
        forward_s={1: forward_s},
        backward_s={1: backward_s},
        activation_bytes={1: nbytes},
        activation_memory_bytes={1: nbytes},
        param_bytes=4,
        grad_bytes=4,
        optimizer_bytes=0,
        update_s=0.0,
    )
    return CostTable(
        model_signature="varuna-calibration",
        segments=[segment] * stages,
        network=table.network,
        micro_batch_sizes=[1],
        device=table.device,
        compute_slowdown=sharing,
    )


def _measure(
    engine_class: Callable[..., Any],
    stages: int,
    microbatches: int,
    forward_s: float,
    backward_s: float,
    width: int,
    steps: int,
    warmup: int,
) -> float:
    """Median over the timed steps of the slowest rank's step time of the spin pipeline, built
    with `engine_class` (`varuna.Varuna`). The process's RNG is left as it was (under
    `pipeline="auto"` the user's training follows)."""

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _SpinModel(stages, forward_s, backward_s)
        batch = {"x": torch.randn(microbatches, width)}
    with torch.random.fork_rng(devices=[]), _private_engine_env() as scratch:
        engine = engine_class(
            model,
            pipeline=stages,
            data=1,
            global_batch_size=microbatches,
            micro_batch_size=1,
            schedule="1f1b",
            partition=list(range(stages - 1)),
            example_batch=batch,
            run_dir=scratch,
            split_backward=False,  # a spin's backward is all input gradient: nothing to split
        )
        try:
            engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.0))
            times = []
            for k in range(warmup + steps):
                dist.barrier()
                start = time.perf_counter()
                engine.step(batch)
                if k >= warmup:
                    times.append(time.perf_counter() - start)
        finally:
            engine.close()
    every: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, times)
    return statistics.median(max(t) for t in zip(*every))


def fit_action_overhead(
    table: CostTable,
    engine_class: Callable[..., Any],
    *,
    steps: int = 8,
    warmup: int = 2,
    layout: Sequence[tuple[str, int]] | None = None,
) -> float:
    """Seconds per compute action the runtime costs beyond `table`'s compute (see the module),
    measured with `engine_class` (`varuna.Varuna`, handed in: the engine imports the profile).

    Collective: every rank of the job calls it with the same `table` and gets the same value.
    0 on CUDA, with fewer than 2 ranks, or where no host runs more ranks than it has cores
    (`shares_cores`). `layout` is the job's `host_layout()` where the caller has it already (None:
    gathered here). Takes about `steps + warmup` steps of the model split over every rank of the
    job, plus the engine's start-up.
    """
    if table.device != "cpu":
        return 0.0
    world = dist.get_world_size()
    if world < 2:
        return 0.0
    layout = host_layout() if layout is None else layout
    if not shares_cores(layout):
        return 0.0
    mbs = table.micro_batch_sizes[0]
    forward_s = sum(s.forward_s[mbs] for s in table.segments) / world
    backward_s = sum(s.backward_s[mbs] for s in table.segments) / world
    cut_bytes = [s.activation_bytes[mbs] for s in table.segments[:-1]] or [4]
    nbytes = max(int(statistics.median(cut_bytes)), 4)
    width = max(nbytes // 4, 1)
    microbatches = 2 * world
    sharing = _core_sharing(layout)
    measured = _measure(engine_class, world, microbatches, forward_s, backward_s, width, steps, warmup)
    spin = _spin_table(table, world, forward_s, backward_s, width * 4, sharing)

    def predicted(overhead: float) -> float:
        candidate = predict(
            replace(spin, action_overhead_s=overhead),
            pipeline=world,
            data=1,
            micro_batch_size=1,
            schedule="1f1b",
            global_batch_size=microbatches,
            boundaries=list(range(world - 1)),
            split_backward=False,
        )
        return candidate.predicted_step_s

    return _solve(predicted, measured)


def _solve(predicted: Callable[[float], float], measured: float, tolerance: float = 1e-6) -> float:
    """The overhead >= 0 at which the nondecreasing `predicted` reaches `measured` (bisection); 0
    when the prediction without any already reaches it."""
    if predicted(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, max(measured, tolerance)
    while predicted(hi) < measured:  # the whole step per action and still short: widen
        hi *= 2
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2
