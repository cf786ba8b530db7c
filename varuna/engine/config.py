"""The settings of a Varuna job, as the user gives them: one flat set of keyword arguments, each
owned and validated by the component that reads it.

    Varuna(model, pipeline=2, data=2, ..., checkpoint_keep=5, memory_limit="16GiB", on_stop="flag")
            |                                   |                   |                 |
      EngineConfig (here)        CheckpointConfig (varuna.checkpoint) PlannerConfig  ElasticConfig

`VarunaConfig(**options)` routes each keyword to its component's dataclass (which validates it where
it is made, so a bad value fails before any process group exists), keeps `run_dir` for the job as a
whole, and reads flat (`config.pipeline`, `config.checkpoint_keep`) for scripts and notebooks. An
option no component owns is a ConfigError naming the closest and every valid one. `options()` gives
the flat form back (engine.json, checkpoints' extra data). The engine builds it, so it lives here.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from varuna.checkpoint.config import CheckpointConfig
from varuna.elastic.config import ElasticConfig
from varuna.errors import ConfigError, check_int, check_number
from varuna.planner.config import PlannerConfig
from varuna.schedule import SCHEDULES, ScheduleName, schedule_spec

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The precisions an engine trains in (`varuna.engine.precision` applies them)."""

__all__ = ["VarunaConfig", "EngineConfig", "OPTIONS", "PRECISIONS", "check_options"]


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How one replica of the pipeline is laid out and how a step runs on it."""

    pipeline: int
    """P: number of pipeline stages."""
    data: int
    """D: number of data-parallel replicas of the pipeline."""
    global_batch_size: int
    """Samples per optimizer step over all replicas; stays fixed when P x D changes."""
    micro_batch_size: int
    """Samples per micro-batch; each replica runs global_batch_size / (data * micro_batch_size) of them."""
    schedule: ScheduleName = "1f1b"
    """Order of forward/backward work on each stage (see varuna.schedule)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, or autocast to bf16 or fp16 (fp16 adds a loss scaler agreed over all ranks)."""
    shared_weights: Sequence[Sequence[str]] = ()
    """Groups of parameter names that are one weight (gradients summed, values kept equal)."""
    partition: Literal["balanced", "fastest", "uniform"] | Sequence[int] = "balanced"
    """'balanced' by measured time per segment; 'fastest': balanced, then each boundary moved while the
    simulated step of this schedule gets shorter (`varuna.planner.cuts`); 'uniform' by parameter
    count; or P-1 CutPoint indices."""
    recompute: bool | None = None
    """Recompute forward just before backward on non-last stages; default: only for 'varuna'."""
    split_backward: bool = True
    """On stages after the first, compute the input gradient of the step's first and last backward
    before their weight gradients, and send it at once: the previous stage waits for it, nobody
    for the weights (see varuna.schedule.split_backwards). False: one plain backward() each. Off
    for a model with gradient checkpointing (a module whose `gradient_checkpointing` is True, as
    transformers sets it), whose blocks each backward pass would recompute."""
    fuse_weights: bool = True
    """zb-h1 and zb-v (whose orders place every weight half W themselves and are fitted to the
    profiled stage costs): each W whose deferral shortens nothing on those costs runs inside its B,
    one whole backward, since a split costs more than a whole one (`StageCost` prices both); the
    W's that fill a wait stay split (`varuna.schedule.chunked.fuse_weights`). False: every W where
    the schedule places it, as in the paper."""
    refit_after: int | None = 2
    """zb-h1 and zb-v: after this many steps (of this process) the order, and which W's stay split,
    is fitted again to the chunk costs the last step measured, which the start-up profile only
    estimates (`varuna.engine.refit`). None: keep the order fitted to the profile."""
    optimizer_state: Literal["adam", "momentum", "none"] = "adam"
    """The optimizer state the memory check counts per parameter: "adam" two moments (AdamW, Adam),
    "momentum" one (SGD with momentum), "none" (plain SGD); the state is in the parameters' dtype."""
    clip_grad_norm: float | None = None
    """Clip gradients by their global norm over all stages (None: no clipping)."""
    on_nonfinite: Literal["raise", "skip"] = "raise"
    """A NaN or Inf loss or gradient (fp32, bf16): "raise" stops before the optimizer with a
    NonFiniteError naming the step, stage and module where it first appeared
    (`varuna.engine.nonfinite`); "skip" skips that update and counts it (`engine.nonfinite_steps`).
    fp16 skips such steps through its loss scaler either way."""
    bucket_mb: float = 25.0
    """Size of the data-parallel all-reduce buckets."""
    overlap_allreduce: bool = True
    """Start each bucket's data-parallel all-reduce as soon as its gradients are final, during the
    stage's last backward (as DDP does), instead of after the stage's last action; the result is the
    same. Off where the links are serial (NCCL's just-in-time path, `varuna.comm.serial`), whose
    held sends must go out before any collective."""
    allreduce_dtype: Literal["bf16"] | None = None
    """None: all-reduce the gradients in their own dtype (training equal to one process). "bf16":
    all-reduce a bfloat16 copy of each bucket (half the bytes on a slow network) and copy the mean
    back into the gradients, which then differ from one process's by bfloat16's rounding."""
    init_loss_scale: float = 2.0**16
    """First fp16 loss scale."""
    profile_repeats: int = 3
    """Measured repetitions of the start-up segment profile."""
    notice_s: float | None = None
    """The preemption notice window, seconds: a SIGTERM on a rank means its host goes away this
    long after, and the job trains on while one more step and a checkpoint still fit before then
    (`varuna.engine.notice`). None: ``VARUNA_NOTICE_S`` (90, 90s, 2min) if set, else SIGTERM stops
    at the end of the step, like SIGUSR1."""

    def __post_init__(self) -> None:
        for name in ("pipeline", "data", "global_batch_size", "micro_batch_size", "profile_repeats"):
            check_int(getattr(self, name), name)
        per_step = self.data * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by data x micro_batch_size = "
                f"{self.data} x {self.micro_batch_size} = {per_step}; choose a global batch that is a multiple "
                f"of {per_step} (e.g. {max(per_step, self.global_batch_size // per_step * per_step)}) or "
                "another micro_batch_size"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is not one of {tuple(SCHEDULES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not one of {PRECISIONS}")
        if isinstance(self.partition, str):
            if self.partition not in ("balanced", "fastest", "uniform"):
                raise ConfigError(
                    f"partition={self.partition!r}: use 'balanced', 'fastest', 'uniform' or a list of P-1 "
                    "CutPoint indices"
                )
        elif not all(isinstance(b, int) for b in self.partition):
            raise ConfigError(
                f"partition={list(self.partition)!r} must be a list of integer CutPoint indices"
            )
        if self.on_nonfinite not in ("raise", "skip"):
            raise ConfigError(
                f"on_nonfinite={self.on_nonfinite!r}: use 'raise' (stop with an error) or 'skip'"
            )
        if self.optimizer_state not in ("adam", "momentum", "none"):
            raise ConfigError(
                f"optimizer_state={self.optimizer_state!r}: use 'adam' (AdamW, Adam), 'momentum' (SGD with "
                "momentum) or 'none' (plain SGD)"
            )
        r = self.refit_after
        if r is not None:
            check_int(
                r,
                "refit_after",
                message=f"refit_after must be a positive number of steps, or None to keep the order fitted "
                f"to the start-up profile; got {r!r}",
            )
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"clip_grad_norm must be positive or None, got {self.clip_grad_norm}")
        if self.allreduce_dtype not in (None, "bf16"):
            raise ConfigError(
                f"allreduce_dtype={self.allreduce_dtype!r}: use None (the gradients' own dtype) or 'bf16'"
            )
        if not isinstance(self.overlap_allreduce, bool):
            raise ConfigError(f"overlap_allreduce must be True or False, got {self.overlap_allreduce!r}")
        for name in ("bucket_mb", "init_loss_scale"):
            check_number(getattr(self, name), name)
        n = self.notice_s
        if n is not None and (
            isinstance(n, bool) or not isinstance(n, (int, float)) or not 0 <= n < math.inf
        ):
            raise ConfigError(
                f"notice_s={n!r}: give the preemption notice window in seconds (a number >= 0, e.g. 90), "
                "or None"
            )

    @property
    def num_microbatches(self) -> int:
        """Micro-batches each replica runs per step."""
        return self.global_batch_size // (self.data * self.micro_batch_size)

    @property
    def uses_recompute(self) -> bool:
        return schedule_spec(self.schedule).recompute if self.recompute is None else self.recompute


_COMPONENTS: dict[str, type] = {
    "engine": EngineConfig,
    "checkpoint": CheckpointConfig,
    "planner": PlannerConfig,
    "elastic": ElasticConfig,
}
OPTIONS: dict[str, str] = {f.name: part for part, cls in _COMPONENTS.items() for f in fields(cls)} | {
    "run_dir": "job"
}
"""Every user-facing option, mapped to the component that owns it ("job": the config itself)."""


def check_options(options: Mapping[str, Any]) -> None:
    """ConfigError for a keyword that is not an option, naming the closest ones and every valid one
    (a misspelt option would otherwise be a TypeError from deep inside)."""
    unknown = [name for name in options if name not in OPTIONS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(OPTIONS), n=2)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ConfigError(
            f"Varuna(...) got an unknown option {name!r}; {hint}the options are: {', '.join(sorted(OPTIONS))}"
        )


class VarunaConfig:
    """How one training job is laid out and run: the components' configs and the run directory."""

    __slots__ = ("engine", "checkpoint", "planner", "elastic", "run_dir")

    engine: EngineConfig
    checkpoint: CheckpointConfig
    planner: PlannerConfig
    elastic: ElasticConfig
    run_dir: Path | None
    """Where caches, logs and checkpoints go; None keeps nothing on disk."""

    def __init__(self, *, run_dir: str | Path | None = None, **options: Any) -> None:
        check_options(options)
        parts: dict[str, dict[str, Any]] = {part: {} for part in _COMPONENTS}
        for name, value in options.items():
            parts[OPTIONS[name]][name] = value
        missing = [
            n for n in ("pipeline", "data", "global_batch_size", "micro_batch_size") if n not in options
        ]
        if missing:
            raise ConfigError(f"VarunaConfig needs {', '.join(missing)} (positive integers)")
        self.engine = EngineConfig(**parts["engine"])
        self.checkpoint = CheckpointConfig(**parts["checkpoint"])
        self.planner = PlannerConfig(**parts["planner"])
        self.elastic = ElasticConfig(**parts["elastic"])
        self.run_dir = Path(run_dir) if run_dir is not None else None

    def __getattr__(self, name: str) -> Any:
        """Flat reading: `config.pipeline` is `config.engine.pipeline`, and so on for every option."""
        part = OPTIONS.get(name)
        if part is None or part == "job":
            raise AttributeError(f"VarunaConfig has no option {name!r}")
        return getattr(getattr(self, part), name)

    @property
    def num_microbatches(self) -> int:
        return self.engine.num_microbatches

    @property
    def uses_recompute(self) -> bool:
        return self.engine.uses_recompute

    def options(self) -> dict[str, Any]:
        """The flat keyword form, JSON-ready: `VarunaConfig(**config.options())` makes an equal config."""
        flat: dict[str, Any] = {}
        for part in _COMPONENTS:
            flat |= asdict(getattr(self, part))
        flat["run_dir"] = self.run_dir
        for key in ("run_dir", "resume", "weights"):
            flat[key] = str(flat[key]) if flat[key] is not None else None
        flat["shared_weights"] = [list(g) for g in flat["shared_weights"]]
        if not isinstance(flat["partition"], str):
            flat["partition"] = list(flat["partition"])
        return flat

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VarunaConfig) and self.options() == other.options()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"VarunaConfig({', '.join(f'{k}={v!r}' for k, v in self.options().items())})"
