"""One morph protocol for every trigger: a signal, `varuna resize`, or the notebook controller.

    trigger                      every rank                                  the supervisor
    ───────                      ──────────                                  ──────────────
    SIGUSR1 / SIGTERM to any  →  StopRequest set; at the end of the step   → exit status MORPH_EXIT:
    worker, or a resize            the stop flag rides the per-step           read the oldest resize
    request (which signals         all-reduce, so all ranks agree; write      request (or keep the
    the workers)                   a checkpoint; exit with MORPH_EXIT         shape) and relaunch from
                                                                              checkpoints/latest

The user's script holds no signal handler: the engine installs one. This module imports no torch,
so the CLI and the controller can use it cheaply.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varuna._files import write_json_atomic
from varuna.errors import ConfigError

__all__ = [
    "MORPH_EXIT",
    "StopRequest",
    "request_resize",
    "take_resize",
    "live_workers",
    "choose_shape",
    "shape_for_gpus",
]

MORPH_EXIT = 75
"""Exit status of a job that checkpointed on request and is ready to relaunch in a new shape
(EX_TEMPFAIL in sysexits.h: try again)."""

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Set by a signal or a call; read by the engine at the end of every step."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def __bool__(self) -> bool:
        return self.reason is not None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def install(self) -> bool:
        """Handle SIGUSR1 and SIGTERM by setting the request (main thread only; else a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in STOP_SIGNALS:
            signal.signal(sig, lambda signum, _frame: self.set(signal.Signals(signum).name))
        return True


@dataclass(frozen=True, slots=True)
class Shape:
    pipeline: int
    data: int


@dataclass(frozen=True, slots=True)
class ShapeChoice:
    """A shape for a resize and how it was chosen."""

    shape: Shape
    chosen_by: str
    """"planner" (from RUN_DIR/profile.json) or "rule" (`choose_shape`: keep the pipeline depth)."""
    reason: str
    """One line for people, e.g. "planner (runs/gpt/profile.json): predicted 0.21 s/step, best of 9"."""


def _requests(run_dir: Path) -> Path:
    return Path(run_dir) / "requests"


def live_workers(run_dir: Path) -> list[int]:
    """PIDs of this run's ranks that report themselves running (on this host), by rank."""
    from varuna._postmortem import read_reports

    statuses, _ = read_reports(Path(run_dir))
    pids = []
    for _, status in sorted(statuses.items()):
        pid = status.get("pid")
        if status.get("state") == "running" and isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            pids.append(pid)
    return pids


def request_resize(run_dir: Path, *, pipeline: int, data: int, notify: bool = True) -> Path:
    """Queue a new shape for the job in `run_dir` and, with `notify`, ask its workers to morph now."""
    for name, value in (("pipeline", pipeline), ("data", data)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"resize needs a positive {name}, got {value!r}")
    run_dir = Path(run_dir)
    if notify and not (run_dir / "job.json").exists():
        raise ConfigError(f"{run_dir} is not a varuna run directory (it has no job.json)")
    folder = _requests(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = write_json_atomic(
        folder / f"resize-{time.time_ns()}.json", {"pipeline": pipeline, "data": data, "time": time.time()}
    )
    if notify:
        for pid in live_workers(run_dir)[:1]:  # one is enough: the stop flag is all-reduced
            os.kill(pid, signal.SIGUSR1)
    return path


def take_resize(run_dir: Path) -> Shape | None:
    """The oldest queued resize request, removed from the queue (None if there is none)."""
    folder = _requests(Path(run_dir))
    pending = sorted(folder.glob("resize-*.json")) if folder.is_dir() else []
    if not pending:
        return None
    request = json.loads(pending[0].read_text())
    done = folder / "applied"
    done.mkdir(exist_ok=True)
    pending[0].replace(done / pending[0].name)
    return Shape(int(request["pipeline"]), int(request["data"]))


def choose_shape(gpus: int, engine_info: dict[str, Any]) -> Shape:
    """A P x D on `gpus` devices that keeps the global batch, with P as close to the current depth as
    possible and not shallower when avoidable (a shallower pipeline puts more of the model on a device).

    `engine_info` is the run's engine.json (global and micro-batch size, segments, current pipeline).
    """
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {gpus}")
    batch, mbs = engine_info["global_batch_size"], engine_info["micro_batch_size"]
    segments, current = engine_info["num_segments"], engine_info["pipeline"]
    fits = [
        Shape(gpus // d, d)
        for d in range(1, gpus + 1)
        if gpus % d == 0 and batch % (d * mbs) == 0 and gpus // d <= segments
    ]
    if not fits:
        raise ConfigError(
            f"no pipeline x data = {gpus} keeps the global batch {batch} with micro-batches of {mbs} "
            f"and at most {segments} stages; choose another device count or give --pipeline and --data"
        )
    return min(fits, key=lambda s: (s.pipeline < current, abs(s.pipeline - current)))


def shape_for_gpus(run_dir: Path, gpus: int) -> ShapeChoice:
    """The shape `varuna resize --gpus N` asks for: the planner's best when the run directory has a
    profile of this run's model (RUN_DIR/profile.json), else `choose_shape`'s rule; says which.

    The planner keeps what the job keeps across a relaunch: the global batch and, unless the job
    runs with pipeline="auto" (which re-plans everything but what the user fixed), its micro-batch
    size, schedule and recompute. Memory per device is the job's `memory_limit`, else what
    pipeline="auto" assumes (`varuna._auto.device_memory`). Raises ConfigError (a PlanError from
    the planner) when no shape fits.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"zero GPUs: --gpus must be at least 1, got {gpus!r}")
    run_dir = Path(run_dir)
    info_path = run_dir / "engine.json"
    if not info_path.exists():
        raise ConfigError(
            f"{run_dir} has no engine.json yet (has the job started training?); give --pipeline and --data"
        )
    info = json.loads(info_path.read_text())
    profile = run_dir / "profile.json"
    if not profile.is_file():
        shape = choose_shape(gpus, info)
        return ShapeChoice(
            shape, "rule", f"rule (no profile in {run_dir}): keep the pipeline depth near {info['pipeline']}"
        )
    from varuna._auto import Fixed, device_memory, plan_for  # the planner imports torch
    from varuna.costs import CostTable

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
            recompute=info["schedule"] == "varuna" if recompute is None else recompute,
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
