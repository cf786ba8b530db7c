"""The checkpoint settings of a job: where its weights come from (a checkpoint to resume, pretrained
weights, the seed of a fresh initialisation) and how many checkpoints to keep."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from varuna.errors import ConfigError, check_int

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
    init_seed: int = 0
    """Base seed of the initialisation of a model built on the meta device without `weights`: each
    module is initialised under a seed from this and its name, the same at every P x D
    (`varuna.init_weights` gives a plain model the same values)."""

    def __post_init__(self) -> None:
        check_int(self.checkpoint_keep, "checkpoint_keep")
        if self.weights is not None and not isinstance(self.weights, (str, Path)):
            raise ConfigError(
                f"weights must be the path of a safetensors file or folder, got a {type(self.weights).__name__}; "
                "to start from a state dict in memory, load it into the model before Varuna(...)"
            )
        if not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool):
            raise ConfigError(f"init_seed must be an integer, got {self.init_seed!r}")
        if not isinstance(self.allow_batch_change, bool):
            raise ConfigError(f"allow_batch_change must be True or False, got {self.allow_batch_change!r}")
