"""The typed errors Varuna raises on bad input.

Each message says what was expected, what was given, and which setting to change.
"""

from __future__ import annotations

__all__ = [
    "VarunaError",
    "ConfigError",
    "PartitionError",
    "ScheduleError",
    "LaunchError",
    "CheckpointError",
    "MemoryLimitError",
]


class VarunaError(Exception):
    """Base class of every error Varuna raises on purpose."""


class ConfigError(VarunaError, ValueError):
    """An argument of `Varuna(...)` or the CLI does not fit the job (batch sizes, world size, names)."""


class PartitionError(VarunaError, ValueError):
    """The model cannot be cut into the requested stages (CutPoints missing, reused, empty stages)."""


class PlanError(ConfigError):
    """The planner cannot answer: bad resources, a profile of another model, nothing fits."""


class ScheduleError(VarunaError, ValueError):
    """A schedule's action lists break an invariant; the message prints the stage x step grid."""


class LaunchError(VarunaError, RuntimeError):
    """A job could not be started, or a worker failed; the message names the rank."""


class CheckpointError(VarunaError, RuntimeError):
    """A checkpoint is incomplete, corrupted, or does not match the model."""


class MemoryLimitError(ConfigError):
    """A stage's estimated peak memory is over the memory this rank has: refused before anything
    large is allocated (`varuna.engine.preflight`)."""
