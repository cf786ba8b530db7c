"""Choosing the shape of a relaunch: the planner's best P x D for N devices when the run has a
profile of its model, else a rule that keeps the pipeline depth (`varuna resize --gpus N`, the
elastic supervisor after a change of hosts). Kept apart from `varuna.elastic.protocol`, which
imports no torch: the planner does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varuna.elastic.protocol import Shape
from varuna.errors import ConfigError, check_int
from varuna.schedule import schedule_spec

__all__ = ["ShapeChoice", "choose_shape", "shape_for_gpus", "read_engine_info"]

_ENGINE_KEYS = {
    "pipeline": int,
    "data": int,
    "global_batch_size": int,
    "micro_batch_size": int,
    "num_segments": int,
}


def read_engine_info(path: Path) -> dict[str, Any]:
    """A run's engine.json (what its engine wrote at start), checked for what a resize needs."""
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(
            f"{path} is not readable JSON ({exc}); it is rewritten when the job starts training: wait for that, "
            "or give --pipeline and --data"
        ) from None
    bad = [
        k
        for k, kind in _ENGINE_KEYS.items()
        if not isinstance(info, dict) or not isinstance(info.get(k), kind)
    ]
    if bad:
        got = {k: info.get(k) for k in bad} if isinstance(info, dict) else type(info).__name__
        raise ConfigError(
            f"{path} lacks integer {', '.join(bad)} (has {got}); it is rewritten when the job starts "
            "training: wait for that, or give --pipeline and --data"
        )
    return info


@dataclass(frozen=True, slots=True)
class ShapeChoice:
    """A shape for a resize and how it was chosen."""

    shape: Shape
    chosen_by: str
    """"planner" (from RUN_DIR/profile.json) or "rule" (`choose_shape`: keep the pipeline depth)."""
    reason: str
    """One line for people, e.g. "planner (runs/gpt/profile.json): predicted 0.21 s/step, best of 9"."""


def choose_shape(gpus: int, engine_info: dict[str, Any]) -> Shape:
    """A P x D on `gpus` devices that keeps the global batch, with P as close to the current depth as
    possible and not shallower when avoidable (a shallower pipeline puts more of the model on a device).

    `engine_info` is the run's engine.json (global and micro-batch size, segments, current pipeline).
    """
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {gpus}")
    batch, mbs = engine_info["global_batch_size"], engine_info["micro_batch_size"]
    segments, current = engine_info["num_segments"], engine_info["pipeline"]
    spec = schedule_spec(engine_info.get("schedule", "1f1b"))
    chunks = spec.chunks_per_rank  # a multi-chunk schedule cuts P x chunks stages
    rounds = spec.rounds  # micro-batches in rounds of P: M a multiple of P

    def runs(p: int, d: int) -> bool:
        return p * chunks <= segments and not (rounds and (batch // (d * mbs)) % p)

    fits = [
        Shape(gpus // d, d)
        for d in range(1, gpus + 1)
        if gpus % d == 0 and batch % (d * mbs) == 0 and runs(gpus // d, d)
    ]
    if not fits:
        per = f" ({chunks} chunks per rank for {engine_info.get('schedule')})" if chunks > 1 else ""
        raise ConfigError(
            f"no pipeline x data = {gpus} keeps the global batch {batch} with micro-batches of {mbs} "
            f"and at most {segments} stages{per}; choose another device count or give --pipeline and --data"
        )
    return min(fits, key=lambda s: (s.pipeline < current, abs(s.pipeline - current)))


def shape_for_gpus(run_dir: Path, gpus: int, *, depth: int | None = None) -> ShapeChoice:
    """The shape `varuna resize --gpus N` asks for: the planner's best when the run directory has a
    profile of this run's model (RUN_DIR/profile.json), else `choose_shape`'s rule, keeping the
    pipeline depth near `depth` (default: the running one); says which.

    The planner keeps what the job keeps across a relaunch: the global batch and, unless the job
    runs with pipeline="auto" (which re-plans everything but what the user fixed), its micro-batch
    size, schedule and recompute. Memory per device is the job's `memory_limit`, else what
    pipeline="auto" assumes (`varuna.planner.auto.device_memory`). Raises ConfigError (a PlanError from
    the planner) when no shape fits.
    """
    check_int(gpus, "--gpus", message=f"zero GPUs: --gpus must be at least 1, got {gpus!r}")
    run_dir = Path(run_dir)
    info_path = run_dir / "engine.json"
    if not info_path.exists():
        raise ConfigError(
            f"{run_dir} has no engine.json yet (has the job started training?); give --pipeline and --data"
        )
    info = read_engine_info(info_path)
    if depth is not None:
        info = {**info, "pipeline": depth}
    profile = run_dir / "profile.json"
    if not profile.is_file():
        shape = choose_shape(gpus, info)
        return ShapeChoice(
            shape, "rule", f"rule (no profile in {run_dir}): keep the pipeline depth near {info['pipeline']}"
        )
    from varuna.planner.auto import Fixed, device_memory, plan_for  # the planner imports torch
    from varuna.planner.costs import CostTable

    table = CostTable.load(profile)
    signature = info.get("model_signature")
    if signature is not None and signature != table.model_signature:
        shape = choose_shape(gpus, info)
        return ShapeChoice(
            shape,
            "rule",
            f"rule ({profile} is a profile of another model): keep the pipeline depth near {info['pipeline']}",
        )
    auto = info.get("plan")
    if auto:
        fixed = Fixed.from_json(auto.get("fixed") or {})
    else:
        recompute = info.get("recompute")
        fixed = Fixed(
            micro_batch_size=info["micro_batch_size"],
            schedule=info["schedule"],
            recompute=schedule_spec(info["schedule"]).recompute if recompute is None else recompute,
        )
    result = plan_for(
        table,
        gpus=gpus,
        memory_bytes=device_memory(info.get("memory_limit"), gpus),
        global_batch_size=info["global_batch_size"],
        fixed=fixed,
        signature=signature,
    )
    best = result.best
    return ShapeChoice(
        Shape(best.pipeline, best.data),
        "planner",
        f"planner ({profile}): predicted {best.predicted_step_s:.4g} s/step with micro-batches of "
        f"{best.micro_batch_size}, {best.schedule}, best of {len(result.ranked)}",
    )
