"""The settings of a Varuna engine: one typed dataclass, validated where it is made."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

from varuna.errors import ConfigError
from varuna.schedule import SCHEDULES, schedule_spec

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16")
"""The precisions an engine trains in (`varuna.engine.precision` applies them)."""

__all__ = ["VarunaConfig", "check_options"]


@dataclass(kw_only=True, slots=True)
class VarunaConfig:
    """How one training job is laid out and run."""

    pipeline: int
    """P: number of pipeline stages."""
    data: int
    """D: number of data-parallel replicas of the pipeline."""
    global_batch_size: int
    """Samples per optimizer step over all replicas; stays fixed when P x D changes."""
    micro_batch_size: int
    """Samples per micro-batch; each replica runs global_batch_size / (data * micro_batch_size) of them."""
    schedule: Literal["gpipe", "1f1b", "varuna"] = "1f1b"
    """Order of forward/backward work on each stage (see varuna.schedule)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, or autocast to bf16 or fp16 (fp16 adds a loss scaler agreed over all ranks)."""
    shared_weights: Sequence[Sequence[str]] = ()
    """Groups of parameter names that are one weight (gradients summed, values kept equal)."""
    partition: Literal["balanced", "uniform"] | Sequence[int] = "balanced"
    """'balanced' by measured time per segment, 'uniform' by parameter count, or P-1 CutPoint indices."""
    recompute: bool | None = None
    """Recompute forward just before backward on non-last stages; default: only for 'varuna'."""
    split_backward: bool = True
    """On stages after the first, compute the input gradient of the step's first and last backward
    before their weight gradients, and send it at once: the previous stage waits for it, nobody
    for the weights (see varuna.schedule.split_backwards). False: one plain backward() each."""
    clip_grad_norm: float | None = None
    """Clip gradients by their global norm over all stages (None: no clipping)."""
    run_dir: Path | None = None
    """Where caches, logs and checkpoints go; None keeps nothing on disk."""
    bucket_mb: float = 25.0
    """Size of the data-parallel all-reduce buckets."""
    init_loss_scale: float = 2.0**16
    """First fp16 loss scale."""
    profile_repeats: int = 3
    """Measured repetitions of the start-up segment profile."""
    resume: str | Path | None = None
    """"latest" (the run directory's newest checkpoint, if any) or a checkpoint directory to start from."""
    checkpoint_keep: int = 3
    """How many committed checkpoints to keep in the run directory."""
    allow_batch_change: bool = False
    """Resume a checkpoint saved with another global batch size (changes the data order from there on)."""
    memory_limit: int | str | None = None
    """Memory per device that pipeline="auto" plans for ("16GiB" or bytes); None: the CUDA device's
    total, or on CPU the host's RAM shared by the ranks."""
    on_stop: Literal["exit", "flag"] = "exit"
    """On a stop request (signal, resize, controller): checkpoint and exit with MORPH_EXIT, or only set
    `engine.should_stop` and let the script decide."""

    def __post_init__(self) -> None:
        for name in (
            "pipeline",
            "data",
            "global_batch_size",
            "micro_batch_size",
            "checkpoint_keep",
            "profile_repeats",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        per_step = self.data * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by data x micro_batch_size = "
                f"{self.data} x {self.micro_batch_size} = {per_step}; choose a global batch that is a multiple "
                f"of {per_step} (e.g. {max(per_step, self.global_batch_size // per_step * per_step)}) or "
                "another micro_batch_size"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision={self.precision!r} is not one of {PRECISIONS}")
        if isinstance(self.partition, str):
            if self.partition not in ("balanced", "uniform"):
                raise ConfigError(
                    f"partition={self.partition!r}: use 'balanced', 'uniform' or a list of P-1 CutPoint indices"
                )
        elif not all(isinstance(b, int) for b in self.partition):
            raise ConfigError(
                f"partition={list(self.partition)!r} must be a list of integer CutPoint indices"
            )
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(f"clip_grad_norm must be positive or None, got {self.clip_grad_norm}")
        if self.run_dir is not None:
            self.run_dir = Path(self.run_dir)
        for name in ("bucket_mb", "init_loss_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if self.memory_limit is not None:
            from varuna.planner.memory import parse_memory  # a PlanError (a ConfigError) names the format

            parse_memory(self.memory_limit)
        if self.on_stop not in ("exit", "flag"):
            raise ConfigError(f"on_stop={self.on_stop!r}: use 'exit' or 'flag'")

    @property
    def num_microbatches(self) -> int:
        """Micro-batches each replica runs per step."""
        return self.global_batch_size // (self.data * self.micro_batch_size)

    @property
    def uses_recompute(self) -> bool:
        return schedule_spec(self.schedule).recompute if self.recompute is None else self.recompute


def check_options(options: Mapping[str, Any]) -> None:
    """ConfigError for a keyword that is not a setting of `VarunaConfig`, naming the closest ones and
    every valid one (a misspelt option would otherwise be a TypeError from deep inside)."""
    valid = [f.name for f in fields(VarunaConfig)]
    unknown = [name for name in options if name not in valid]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, valid, n=2)
        hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
        raise ConfigError(
            f"Varuna(...) got an unknown option {name!r}; {hint}the options are: {', '.join(sorted(valid))}"
        )
