"""`Varuna(..., pipeline="auto")`: the planner's best configuration for the job's world size.

    engine = Varuna(model, global_batch_size=32, pipeline="auto", example_batch=batch)
    print(engine.describe())     # ... planned (pipeline="auto"): best of 14 for 4 devices ...

On every rank, before the engine builds anything (`choose`):

    1. the profile   RUN_DIR/profile.json when it was measured on this model, in this precision,
                     with at least this many ranks, and holds a fixed micro-batch size; otherwise
                     `varuna.profile.run_profile` (collective: network and compute slowdown on all
                     ranks, the model on rank 0), which writes it there for the next launch
    2. the plan      on rank 0: `varuna.plan.plan` for P x D = world size under the memory limit
    3. the choice    broadcast from rank 0 (or the planner's error, so every rank raises the same)

What the user passes stays fixed: `micro_batch_size`, `data`, `schedule`, `recompute`; the plan
chooses the rest: P = world / D, the micro-batch size, the schedule, recompute and the stage
boundaries. The launcher's --pipeline / --data only set the world size. `plan_for` is the same
search for another device count: `varuna resize --gpus N` uses it on a run's engine.json.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from varuna.costs import CostTable, model_signature
from varuna.errors import ConfigError
from varuna.plan import PlanError, PlanResult, format_bytes, parse_memory, plan
from varuna.schedule import SCHEDULES

__all__ = ["Fixed", "AutoChoice", "choose", "plan_for", "device_memory", "profile_sizes"]

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
    """`plan` restricted to what the user fixed: the search `pipeline="auto"` runs."""
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
    )


def _usable(table: CostTable, *, signature: str, precision: str, world: int, fixed: Fixed) -> bool:
    """Whether a cached profile answers this job's question (else it is measured again)."""
    return (
        table.model_signature == signature
        and table.precision == precision
        and max(table.compute_slowdown, default=1) >= world
        and (fixed.micro_batch_size is None or fixed.micro_batch_size in table.micro_batch_sizes)
    )


def _cached(path: Path | None, **question: Any) -> tuple[CostTable | None, str]:
    if path is None or not path.is_file():
        return None, "no profile yet"
    try:
        table = CostTable.load(path)
    except ConfigError as exc:
        return None, f"the profile there is unreadable ({exc})"
    if not _usable(table, **question):
        return None, "the profile there is of another model, precision, size or rank count"
    return table, "cached"


def _broadcast(value: Any, world: int) -> Any:
    if world == 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def choose(
    model: Any,
    *,
    rank: int,
    world: int,
    global_batch_size: int,
    fixed: Fixed,
    precision: str,
    example_batch: Mapping[str, Any] | None,
    run_dir: Path | None,
    partition: str | Sequence[int],
    options: Mapping[str, Any],
) -> AutoChoice:
    """Collective (every rank calls it): profile if needed, plan on rank 0, broadcast the choice.

    `options` are the engine's other settings: `memory_limit` and `profile_repeats` matter here.
    """
    if partition != "balanced":
        raise ConfigError(
            f"pipeline='auto' chooses the stage boundaries itself, but partition={partition!r} was given; "
            "drop partition=, or give pipeline= and data= to use your own"
        )
    if example_batch is None:
        raise ConfigError(
            "pipeline='auto' needs example_batch=: one batch dict, as given to step(), to profile the "
            "model's segments before choosing P x D"
        )
    memory = device_memory(options.get("memory_limit"), world)
    repeats = int(options.get("profile_repeats", 3))
    if world == 1:
        return _single(global_batch_size, fixed, memory)
    from varuna.profile import run_profile

    path = run_dir / PROFILE_FILE if run_dir is not None else None
    signature = model_signature(model)
    question = {"signature": signature, "precision": precision, "world": world, "fixed": fixed}
    table, why = _cached(path, **question) if rank == 0 else (None, "")
    measure = _broadcast(table is None, world)
    if measure:
        if rank == 0:
            print(f"varuna: pipeline='auto': profiling the model ({why})", flush=True)
        sizes = [fixed.micro_batch_size] if fixed.micro_batch_size else profile_sizes(global_batch_size)
        table = run_profile(
            model,
            example_batch,
            micro_batch_sizes=sizes,
            precision=precision,
            repeats=repeats,
            run_dir=run_dir,
            progress=rank == 0,
        )
    answer: dict[str, Any] = {}
    if rank == 0:
        assert table is not None
        try:
            result = plan_for(
                table, gpus=world, memory_bytes=memory, global_batch_size=global_batch_size, fixed=fixed,
                signature=signature,
            )  # fmt: skip
            answer = _record(result, fixed, memory, path, reused=not measure)
        except PlanError as exc:
            answer = {"error": str(exc)}
    answer = _broadcast(answer, world)
    if "error" in answer:
        raise PlanError(f"pipeline='auto': {answer['error']}")
    best = answer["best"]
    return AutoChoice(
        pipeline=best["pipeline"],
        data=best["data"],
        micro_batch_size=best["micro_batch_size"],
        schedule=best["schedule"],
        recompute=best["recompute"],
        boundaries=tuple(best["boundaries"]),
        info=answer,
    )


def _record(
    result: PlanResult, fixed: Fixed, memory: int, path: Path | None, *, reused: bool
) -> dict[str, Any]:
    return {
        "source": "pipeline='auto'",
        "profile": str(path) if path is not None else None,
        "profile_reused": reused,
        "gpus": result.gpus,
        "memory_bytes": memory,
        "global_batch_size": result.global_batch_size,
        "fixed": fixed.to_json(),
        "candidates": len(result.ranked),
        "rejected": len(result.rejected),
        "best": result.best.to_json(),
        "runner_up": result.ranked[1].to_json() if len(result.ranked) > 1 else None,
    }


def _single(global_batch_size: int, fixed: Fixed, memory: int) -> AutoChoice:
    """One process: 1 x 1; nothing to plan, so no profile (the largest profiled size by default)."""
    mbs = fixed.micro_batch_size or profile_sizes(global_batch_size)[-1]
    schedule = fixed.schedule or "1f1b"
    info = {
        "source": "pipeline='auto'",
        "profile": None,
        "gpus": 1,
        "memory_bytes": memory,
        "global_batch_size": global_batch_size,
        "fixed": fixed.to_json(),
        "note": "one process: 1 x 1 without profiling",
        "best": {"pipeline": 1, "data": 1, "micro_batch_size": mbs, "schedule": schedule},
    }
    return AutoChoice(
        pipeline=1, data=1, micro_batch_size=mbs, schedule=schedule, recompute=False, boundaries=(), info=info
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
