"""The typed errors Varuna raises on bad input.

Each message says what was expected, what was given, and which setting to change.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "VarunaError",
    "ConfigError",
    "PartitionError",
    "ScheduleError",
    "LaunchError",
    "CheckpointError",
    "MemoryLimitError",
    "check_int",
    "check_number",
    "check_duration",
    "is_int",
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


def is_int(value: object) -> bool:
    """Whether `value` is an integer as an option means it: an int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    value: object,
    name: str,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    error: type[VarunaError] = ConfigError,
    message: str | None = None,
) -> int:
    """The one check of an integer option: `value` if it is an int (not a bool, not a string) from
    `minimum` to `maximum`; else `error` with `message`, or a message naming `name`, the range and
    what was given.

        check_int(keep, "checkpoint_keep")                # "checkpoint_keep must be a positive integer, got 0"
        check_int(n, "--gpus", minimum=2, message=f"--gpus {n!r}: profiling the network needs at least 2 ranks")
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= minimum and (maximum is None or value <= maximum):
            return value
    if message is None:
        if maximum is not None:
            wanted = f"an integer from {minimum} to {maximum}"
        else:
            wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        message = f"{name} must be {wanted}, got {value!r}"
    raise error(message)


def check_number(
    value: object,
    name: str,
    *,
    above: float = 0.0,
    inclusive: bool = False,
    error: type[VarunaError] = ConfigError,
    message: str | None = None,
) -> float:
    """The one check of a real-valued option: `value` as a float if it is an int or float (not a
    bool), finite and greater than `above` (or equal to it, with `inclusive`); else `error` with
    `message`, or a message naming `name`."""
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= above if inclusive else value > above)
    ):
        return float(value)
    raise error(message or f"{name} must be a number {'>=' if inclusive else '>'} {above:g}, got {value!r}")


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)?")
_DURATION_UNITS = {None: 1.0, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}


def check_duration(
    value: object, *, message: str, unit_required: bool = False, positive: bool = False
) -> float:
    """Seconds of a duration: a number with a unit ("90s", "2min", "1h"; s, sec, min, m, h) or, unless
    `unit_required`, a bare number of seconds (90, "90"); >= 0, or > 0 with `positive`; else a
    ConfigError with `message` (which says what to give, in the option's own words)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not unit_required:
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(value.strip()) if isinstance(value, str) else None
        if match is None or (unit_required and match.group(2) is None):
            raise ConfigError(message)
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise ConfigError(message)
    return seconds
