"""What `Varuna(..., pipeline="auto")` may choose and how: the fixed settings, the choice, the
search for a device count (`plan_for`; `varuna resize --gpus N` uses it on a run's engine.json) and
its one-line description. The collective that profiles, plans on rank 0 and broadcasts the answer
is `varuna.engine.auto.choose`, above the profile and the planner.

What the user passes stays fixed: `micro_batch_size`, `data`, `schedule`, `recompute`; the plan
chooses the rest: P = world / D, the micro-batch size, the schedule, recompute and the stage
boundaries. The launcher's --pipeline / --data only set the world size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from varuna.planner.cluster import Cluster
from varuna.planner.costs import CostTable
from varuna.planner.search import PlanError, PlanResult, format_bytes, parse_memory, plan
from varuna.schedule import SCHEDULES

__all__ = ["Fixed", "AutoChoice", "plan_for", "device_memory", "profile_sizes", "describe"]

PROFILE_FILE = "profile.json"
_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True, kw_only=True, slots=True)
class Fixed:
    """What the user fixed for an auto plan; None leaves the choice to the planner."""

    micro_batch_size: int | None = None
    data: int | None = None
    schedule: str | None = None
    recompute: bool | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (engine.json's `plan.fixed`)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Fixed:
        """Inverse of `to_json`."""
        return cls(**{k: data.get(k) for k in ("micro_batch_size", "data", "schedule", "recompute")})


@dataclass(kw_only=True, slots=True)
class AutoChoice:
    """The configuration an auto engine runs, and the record of how it was chosen."""

    pipeline: int
    data: int
    micro_batch_size: int
    schedule: str
    recompute: bool
    boundaries: tuple[int, ...]
    info: dict[str, Any]
    """What `describe()` and engine.json's "plan" say: the inputs, the best candidate, counts."""


def profile_sizes(global_batch_size: int) -> list[int]:
    """Micro-batch sizes an auto engine profiles when the user fixed none: powers of two up to 32
    that divide the global batch (the four largest of them, to bound the profile's time)."""
    return [m for m in _SIZES if global_batch_size % m == 0][-4:]


def device_memory(limit: int | str | None, world: int) -> int:
    """Bytes per device the plan must fit in: `limit` ("16GiB", bytes) if given; else the CUDA
    device's total memory, or on CPU the host's RAM shared by the job's ranks."""
    if limit is not None:
        return parse_memory(limit)
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // max(world, 1)


def plan_for(
    table: CostTable,
    *,
    gpus: int,
    memory_bytes: int,
    global_batch_size: int,
    fixed: Fixed,
    signature: str | None = None,
) -> PlanResult:
    """`plan` restricted to what the user fixed: the search `pipeline="auto"` runs (on the
    profile's hosts where its network section names them, `Cluster.from_network`)."""
    if fixed.data is not None and (fixed.data < 1 or gpus % fixed.data):
        raise PlanError(
            f"data={fixed.data} does not divide the {gpus} devices; with pipeline='auto' pass a data "
            "that divides the world size, or leave it out"
        )
    if fixed.schedule is not None and fixed.schedule not in SCHEDULES:
        raise PlanError(f"schedule={fixed.schedule!r} is not one of {SCHEDULES}")
    return plan(
        table,
        gpus=gpus,
        memory_bytes=memory_bytes,
        global_batch_size=global_batch_size,
        schedules=(fixed.schedule,) if fixed.schedule else SCHEDULES,  # type: ignore[arg-type]
        recompute_options=(fixed.recompute,) if fixed.recompute is not None else (False, True),
        model_signature=signature,
        micro_batch_sizes=None if fixed.micro_batch_size is None else (fixed.micro_batch_size,),
        pipelines=None if fixed.data is None else (gpus // fixed.data,),
        cluster=Cluster.from_network(table.network),
        placements=("block",),  # the running job's: the launcher fills hosts in rank order
    )


def describe(info: Mapping[str, Any]) -> str:
    """One line for `Varuna.describe()`."""
    best = info["best"]
    if "predicted_step_s" not in best:
        return f"planned (pipeline='auto'): {info.get('note', '')}"
    source = "cached profile" if info.get("profile_reused") else "new profile"
    return (
        f"planned (pipeline='auto'): best of {info['candidates']} fitting configurations for {info['gpus']} "
        f"devices of {format_bytes(info['memory_bytes'])}, predicted {best['predicted_step_s']:.4g} s/step "
        f"({source} {info['profile'] or '(not saved: no run directory)'})"
    )
