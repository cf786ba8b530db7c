"""`Varuna(..., pipeline="auto")`: the planner's best configuration for the job's world size.

    engine = Varuna(model, global_batch_size=32, pipeline="auto", example_batch=batch)
    print(engine.describe())     # ... planned (pipeline="auto"): best of 14 for 4 devices ...

On every rank, before the engine builds anything (`choose`):

    1. the profile   RUN_DIR/profile.json when it was measured on this model, in this precision,
                     with at least this many ranks, and holds a fixed micro-batch size; otherwise
                     `varuna.profile.measure.run_profile` (collective: network and compute slowdown on all
                     ranks, the model on rank 0, the runtime's cost per action measured with the
                     engine class handed in), which writes it there for the next launch
    2. the plan      on rank 0: `varuna.planner.auto.plan_for` for P x D = world size under the memory limit
    3. the choice    broadcast from rank 0 (or the planner's error, so every rank raises the same)

`varuna.Varuna` is the class below: the engine (`varuna.engine.Varuna`) with `pipeline="auto"`
resolved before it is built. It sits above the engine, the profile and the planner, so that none of
them imports another in a circle: the profile's calibration gets the engine class from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from varuna import _log
from varuna._log import log
from varuna.comm.rendezvous import init_distributed, launch_env
from varuna.engine.config import check_options
from varuna.engine.engine import Varuna as _Engine
from varuna.engine.materialize import is_meta
from varuna.errors import ConfigError, PlanError
from varuna.planner.auto import PROFILE_FILE, AutoChoice, Fixed, device_memory, plan_for, profile_sizes
from varuna.planner.costs import CostTable, model_signature
from varuna.planner.search import PlanResult

__all__ = ["Varuna", "choose"]


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
    engine: Callable[..., Any],
) -> AutoChoice:
    """Collective (every rank calls it): profile if needed, plan on rank 0, broadcast the choice.

    `options` are the engine's other settings: `memory_limit` and `profile_repeats` matter here.
    `engine` is the engine class, for the profile's calibration.
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
    from varuna.profile.measure import run_profile

    path = run_dir / PROFILE_FILE if run_dir is not None else None
    signature = model_signature(model)
    question = {"signature": signature, "precision": precision, "world": world, "fixed": fixed}
    table, why = _cached(path, **question) if rank == 0 else (None, "")
    measure, why = _broadcast((table is None, why), world)
    if measure and is_meta(model):
        raise PlanError(
            f"pipeline='auto' profiles the model in one process, but this model is on the meta device "
            f"(nothing to time) and {path or 'the run directory'} holds no profile of it ({why or 'no run_dir'}). "
            "Give pipeline= and data= (a meta model is balanced by parameter counts), or profile the real "
            "model once where it fits (`varuna profile`) and keep its profile.json in the run directory"
        )
    if measure:
        if rank == 0:
            log.info("varuna: pipeline='auto': profiling the model (%s)", why)
        sizes = [fixed.micro_batch_size] if fixed.micro_batch_size else profile_sizes(global_batch_size)
        table = run_profile(
            model,
            example_batch,
            micro_batch_sizes=sizes,
            precision=precision,
            repeats=repeats,
            run_dir=run_dir,
            progress=rank == 0,
            engine=engine,
        )
    answer: dict[str, Any] = {}
    if rank == 0:
        assert table is not None
        try:
            result = plan_for(
                table,
                gpus=world,
                memory_bytes=memory,
                global_batch_size=global_batch_size,
                fixed=fixed,
                signature=signature,
            )
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


class Varuna(_Engine):
    """This rank's pipeline stage, and `step(batch)` running one optimizer step over all stages.

    The engine (`varuna.engine.Varuna`), with ``pipeline="auto"`` resolved first: every rank
    profiles (or reuses RUN_DIR/profile.json), rank 0 plans, and the engine is built in the chosen
    P x D, micro-batch size, schedule and boundaries (`choose`). Every other argument is the engine's.
    """

    def __init__(
        self,
        model: Any,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        pipeline: int | str | None = None,
        data: int | None = None,
        schedule: str | None = None,
        recompute: bool | None = None,
        precision: str = "fp32",
        partition: str | Sequence[int] = "balanced",
        example_batch: Mapping[str, Any] | None = None,
        run_dir: str | Path | None = None,
        init: Callable[[str, Any], None] | None = None,
        **options: Any,
    ) -> None:
        check_options(options)  # before a profile that would take minutes
        plan_info = None
        if pipeline == "auto":
            rank, world = init_distributed()
            _log.setup(rank)
            auto = choose(
                model,
                rank=rank,
                world=world,
                global_batch_size=global_batch_size,
                fixed=Fixed(
                    micro_batch_size=micro_batch_size, data=data, schedule=schedule, recompute=recompute
                ),
                precision=precision,
                example_batch=example_batch,
                run_dir=Path(run_dir) if run_dir is not None else launch_env().run_dir,
                partition=partition,
                options=options,
                engine=_Engine,
            )
            pipeline, data, micro_batch_size = auto.pipeline, auto.data, auto.micro_batch_size
            schedule, recompute, partition, plan_info = (
                auto.schedule,
                auto.recompute,
                auto.boundaries,
                auto.info,
            )
        super().__init__(
            model,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            pipeline=pipeline,  # type: ignore[arg-type]
            data=data,
            schedule=schedule,
            recompute=recompute,
            precision=precision,
            partition=partition,
            example_batch=example_batch,
            run_dir=run_dir,
            plan_info=plan_info,
            init=init,
            **options,
        )
