"""The checkpoint settings of a job: where its weights come from (a checkpoint to resume, pretrained
weights, the seed of a fresh initialisation) and how many checkpoints to keep."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from varuna.errors import ConfigError, check_duration, check_int

__all__ = ["CheckpointConfig"]


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    resume: str | Path | None = None
    """"latest" (the run directory's newest checkpoint, if any) or a checkpoint directory to start from."""
    checkpoint_keep: int = 3
    """How many committed checkpoints to keep in the run directory."""
    allow_batch_change: bool = False
    """Resume a checkpoint saved with another global batch size (changes the data order from there on)."""
    weights: str | Path | None = None
    """Pretrained weights to start from: a safetensors file, or a folder holding a Hugging Face
    checkpoint (`model.safetensors`, or `model.safetensors.index.json` and its shards). Each rank reads
    only the tensors its stage holds (`varuna.checkpoint.weights`)."""
    checkpoint_every: int | str | None = None
    """Checkpoint by itself, in the background while training goes on (`checkpoint(blocking=False)`):
    after every N-th step (an int), or once that much time has passed since the last ("30s",
    "10min", "1h"; rank 0's clock decides, so every rank checkpoints after the same step). Needs a
    run directory. None: only when asked."""
    init_seed: int = 0
    """Base seed of the initialisation of a model built on the meta device without `weights`: each
    module is initialised under a seed from this and its name, the same at every P x D
    (`varuna.init_weights` gives a plain model the same values)."""

    def __post_init__(self) -> None:
        check_int(self.checkpoint_keep, "checkpoint_keep")
        every = self.checkpoint_every
        if isinstance(every, str):
            _seconds(every)
        elif every is not None:
            check_int(
                every,
                "checkpoint_every",
                message=f"checkpoint_every must be a number of steps (an int >= 1) or a time such as "
                f"'30s', '10min' or '1h', got {every!r}",
            )
        if self.weights is not None and not isinstance(self.weights, (str, Path)):
            raise ConfigError(
                f"weights must be the path of a safetensors file or folder, got a {type(self.weights).__name__}; "
                "to start from a state dict in memory, load it into the model before Varuna(...)"
            )
        if not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool):
            raise ConfigError(f"init_seed must be an integer, got {self.init_seed!r}")
        if not isinstance(self.allow_batch_change, bool):
            raise ConfigError(f"allow_batch_change must be True or False, got {self.allow_batch_change!r}")

    @property
    def every_steps(self) -> int | None:
        """`checkpoint_every` as a number of steps, when it is one."""
        every = self.checkpoint_every
        return every if isinstance(every, int) and not isinstance(every, bool) else None

    @property
    def every_s(self) -> float | None:
        """`checkpoint_every` as seconds, when it is a time."""
        every = self.checkpoint_every
        return _seconds(every) if isinstance(every, str) else None


def _seconds(every: str) -> float:
    """Seconds of a `checkpoint_every` time ("30s", "10min", "1h"), or a ConfigError."""
    return check_duration(
        every,
        unit_required=True,  # a bare number is a number of steps
        positive=True,
        message=f"checkpoint_every={every!r}: give a number of steps (an int) or a time such as '30s', "
        "'10min' or '1h'",
    )
