"""A timed schedule's order refitted to the chunk costs the pipeline measured
(`EngineConfig.refit_after`).

zb-h1 and zb-v fit their order, and which weight halves stay split (`fuse_weights`), to each
virtual stage's costs: at start-up the profiled segment costs, timed on rank 0 with the whole model
in one process and split into F, B and W by fixed shares. In the pipeline a chunk costs what it
costs there, which can differ from the profile by several percent either way, chunk by chunk; an
order fitted to the profile can then leave one rank waiting on the next (docs/benchmarks/findings.md
has an example).

After `refit_after` steps, at the start of the next, each rank takes the median F, split B, W and
whole B of its chunks from the last step's spans (`varuna.planner.timeline.measured_cost`), one
all-reduce gives every rank every virtual stage's (the mean over replicas), and each rank builds
the order from them (`build_schedule(costs=)`): the same on all, since all build it from the same
numbers. Where the order that ran is as short as the new one on those costs, it stays (the fit is
a heuristic, and a refitted order can run longer than the one it replaces). The cut stays: moving
it would move parameters (`varuna morph` does that).

    refit = OrderRefit.create(config, rank_of, stage=0, chunk_stages=[0], courier=None, device=cpu)
    ...
    new = refit.before_step(engine.last_times, engine.schedule)   # None, or the new schedule
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from varuna._log import log
from varuna.comm.serial import Courier, plan
from varuna.engine.config import VarunaConfig
from varuna.engine.runtime import StepTimes
from varuna.planner.timeline import measured_cost
from varuna.schedule import Schedule, build_schedule, schedule_spec
from varuna.schedule.chunked import order_span

__all__ = ["OrderRefit"]


@dataclass
class OrderRefit:
    """Counts this process's steps and, after `after` of them, refits the order once."""

    config: VarunaConfig
    rank_of: Callable[[int], int]
    stage: int
    chunk_stages: Sequence[int]
    courier: Courier | None
    after: int
    device: torch.device | None = None  # where the all-reduced cost table lives (NCCL: the GPU)
    steps: int = 0
    info: dict[str, Any] | None = field(default=None)
    """After the refit: the step it measured, the costs (per virtual stage: F, split B, W, whole B
    seconds) and the simulated step of the start-up order and of the new one on them."""

    @classmethod
    def create(
        cls,
        config: VarunaConfig,
        rank_of: Callable[[int], int],
        *,
        stage: int,
        chunk_stages: Sequence[int],
        courier: Courier | None,
        device: torch.device | None,
    ) -> OrderRefit | None:
        """A refit for a schedule whose order fits costs (`ScheduleSpec.timed_order`) in a pipeline;
        None where there is nothing to refit or `refit_after` is None."""
        e = config.engine
        if e.refit_after is None or e.pipeline < 2 or not schedule_spec(e.schedule).timed_order:
            return None
        return cls(config, rank_of, stage, list(chunk_stages), courier, e.refit_after, device)

    def before_step(self, last: StepTimes | None, current: Schedule) -> Schedule | None:
        """Collective (every rank, at the start of every step): the refitted schedule once this
        process has run `after` steps (`last`: the latest step's times; `current`: the schedule
        that ran it), else None."""
        self.steps += 1
        if self.steps != self.after + 1 or last is None:
            return None
        e = self.config.engine
        spec = schedule_spec(e.schedule)
        n = e.pipeline * spec.chunks_per_rank
        table = torch.zeros(n, 4, dtype=torch.float64, device=self.device)
        for v in self.chunk_stages:
            spans = [
                {"kind": s.kind, "start": s.start, "end": s.end, "mb": s.microbatch}
                for s in last.spans
                if (s.stage if s.stage is not None else self.chunk_stages[0]) == v
            ]
            cost = measured_cost(spans, unsplit_from_shares=True)
            if cost is not None:
                table[v] = torch.tensor(cost.order_costs(whole=True), dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(table)  # each virtual stage from its `data` holders
        table = table.cpu() / e.data
        if not bool((table > 0).all()):
            return None  # a chunk without a measured F or B: keep the order (the same on every rank)
        costs = [tuple(float(x) for x in row[: 4 if e.fuse_weights else 3]) for row in table]
        lowered = build_schedule(
            e.schedule,
            e.pipeline,
            e.num_microbatches,
            recompute=e.recompute,
            split_backward=e.split_backward,
            costs=costs,
        )
        self.info = {
            "step": self.steps - 1,
            "costs": [list(row) for row in costs],
            "startup_order_s": order_span(current, costs),
            "refitted_order_s": order_span(lowered, costs),
        }
        old, new = self.info["startup_order_s"], self.info["refitted_order_s"]
        if lowered == current or (old is not None and new is not None and old <= new):
            return None  # the order that ran is as short on the measured costs: it stays
        if self.courier is not None:  # NCCL's serial links: each message's tick follows the order
            self.courier.replan(plan(lowered, self.rank_of, self.stage, dist.get_rank()))
        if not dist.is_initialized() or dist.get_rank() == 0:
            timed = f": {old:.3f} s -> {new:.3f} s a step simulated on them" if old and new else ""
            log.info(
                "varuna: %s's order refitted to the chunk costs measured in step %d%s",
                e.schedule,
                self.steps - 1,
                timed,
            )
        return lowered
