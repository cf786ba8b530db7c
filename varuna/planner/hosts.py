"""Planning with measured per-host speeds: is a slow host worth keeping?

Every step of a synchronous job waits for its slowest rank, so a host computing at half speed makes
the whole job run at half speed. Given each host's measured speed (`host_speeds`, from the ranks'
``step_metrics``: a rank's compute time against its stage's fastest, 1.0 = as fast as its peers),
`plan_for_hosts` plans the job on every "all but the k slowest hosts" set, with the profile's compute
costs scaled by the slowest host kept (`scale_compute`), and keeps the fastest predicted step:

    speeds  h1 1.0  h2 1.0  h3 1.0  h4 0.4     all four: 4 devices, every step at h4's pace (compute x 2.5)
                                               without h4: 3 devices at full speed
                                               -> whichever set's best plan predicts the shorter step

The costs are the profile's (`varuna.planner.costs.CostTable`); the search is `varuna.planner.search.plan`.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from varuna.errors import ConfigError
from varuna.planner.costs import CostTable, SegmentCost
from varuna.planner.search import PlanError, PlanResult, plan

__all__ = ["host_speeds", "scale_compute", "plan_for_hosts", "HostPlan"]


def host_speeds(events: Iterable[Mapping[str, Any]], *, job: str | None = None) -> dict[str, float]:
    """Each host's speed, measured: per step and stage, the fastest compute time among the stage's
    ranks over each rank's own; per host, the median over its ranks and steps (the newest launch, or
    `job`). Hosts whose ranks have no peers (one replica) measure 1.0: nothing to compare with."""
    events = list(events)
    if job is None:
        stamped = [e for e in events if e.get("type") == "step_metrics" and e.get("job")]
        job = max(stamped, key=lambda e: float(e.get("time", 0.0)))["job"] if stamped else None
    host_of = {e["rank"]: e.get("host") for e in events if e.get("type") == "hello" and e.get("job") == job}
    cells: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)  # (step, stage) -> rank -> s
    for e in events:
        if e.get("type") == "step_metrics" and e.get("job") == job and e.get("compute_s"):
            cells[(int(e["step"]), int(e.get("stage") or 0))][int(e["rank"])] = float(e["compute_s"])
    ratios: dict[str, list[float]] = defaultdict(list)
    for by_rank in cells.values():
        fastest = min(by_rank.values())
        for rank, seconds in by_rank.items():
            ratios[str(host_of.get(rank))].append(fastest / seconds if seconds > 0 else 1.0)
    return {host: round(statistics.median(r), 3) for host, r in sorted(ratios.items())}


def scale_compute(table: CostTable, factor: float) -> CostTable:
    """`table` with every compute time (forward, backward, recompute, update, per-action overhead)
    multiplied by `factor` (2.0: a device half as fast); memory and network unchanged."""
    if not factor > 0:
        raise ConfigError(f"a compute scale factor must be > 0 (2.0: twice as slow), got {factor!r}")

    def scaled(times: dict[int, float]) -> dict[int, float]:
        return {m: t * factor for m, t in times.items()}

    def seg(s: SegmentCost) -> SegmentCost:
        return replace(
            s,
            forward_s=scaled(s.forward_s),
            backward_s=scaled(s.backward_s),
            recompute_s=None if s.recompute_s is None else scaled(s.recompute_s),
            nograd_forward_s=None if s.nograd_forward_s is None else scaled(s.nograd_forward_s),
            update_s=s.update_s * factor,
        )

    return replace(
        table, segments=[seg(s) for s in table.segments], action_overhead_s=table.action_overhead_s * factor
    )


@dataclass(frozen=True, slots=True)
class HostPlan:
    """The hosts to run on, their slowest speed, and the plan for them."""

    hosts: list[str]
    excluded: list[str]
    slowest_speed: float
    result: PlanResult

    @property
    def predicted_step_s(self) -> float:
        """The best candidate's predicted seconds per step on these hosts."""
        return float(self.result.best.predicted_step_s)


def plan_for_hosts(
    table: CostTable, slots: Mapping[str, int], speeds: Mapping[str, float], **plan_args: Any
) -> HostPlan:
    """The best plan over "every host but the k slowest" (k = 0, 1, ...), each planned with
    `varuna.planner.search.plan` (`plan_args`: memory_bytes, global_batch_size, ...) on its slots
    with compute scaled by its slowest host; hosts missing from `speeds` count as 1.0. Raises PlanError
    when no set fits."""
    if not slots or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in slots.values()):
        raise ConfigError(f"slots must map each host to a positive device count, got {dict(slots)!r}")
    bad = {h: v for h, v in speeds.items() if not v > 0}
    if bad:
        raise ConfigError(f"host speeds must be > 0 (1.0: as fast as its peers), got {bad}")
    order = sorted(slots, key=lambda h: -speeds.get(h, 1.0))  # fastest first, stable for ties
    best: HostPlan | None = None
    errors = []
    for keep in range(len(order), 0, -1):
        hosts = order[:keep]
        slowest = min(speeds.get(h, 1.0) for h in hosts)
        try:
            result = plan(scale_compute(table, 1.0 / slowest), gpus=sum(slots[h] for h in hosts), **plan_args)
        except PlanError as exc:
            errors.append(f"{', '.join(hosts)}: {exc}")
            continue
        candidate = HostPlan(hosts, order[keep:], slowest, result)
        if best is None or candidate.predicted_step_s < best.predicted_step_s:
            best = candidate
    if best is None:
        raise PlanError("no set of hosts fits: " + " | ".join(errors))
    return best
