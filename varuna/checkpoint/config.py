"""The checkpoint settings of a job: where to resume from, how many checkpoints to keep."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from varuna.errors import ConfigError

__all__ = ["CheckpointConfig"]


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    resume: str | Path | None = None
    """"latest" (the run directory's newest checkpoint, if any) or a checkpoint directory to start from."""
    checkpoint_keep: int = 3
    """How many committed checkpoints to keep in the run directory."""
    allow_batch_change: bool = False
    """Resume a checkpoint saved with another global batch size (changes the data order from there on)."""

    def __post_init__(self) -> None:
        keep = self.checkpoint_keep
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"checkpoint_keep must be a positive integer, got {keep!r}")
        if not isinstance(self.allow_batch_change, bool):
            raise ConfigError(f"allow_batch_change must be True or False, got {self.allow_batch_change!r}")
