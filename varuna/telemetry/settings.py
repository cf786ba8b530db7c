"""The telemetry settings a controller may change on a running job (`JobController.set`), checked
in two places: by the controller before anything is sent (a ConfigError in the notebook), and by
every worker on receipt (a bad value is ignored and reported in the rank's log, never fatal: a typo
in the notebook must not end a training run). Torch-free, so the controller can import it.
"""

from __future__ import annotations

from typing import Any

from varuna.errors import ConfigError

__all__ = ["SETTINGS", "check_settings"]

SETTINGS = {
    "paused": "True or False: stop recording spans, metrics and memory (the job goes on)",
    "spans_every": "an integer >= 1: record the spans of every N-th step",
    "min_interval_s": "a number of seconds >= 0: at least this long between two recorded steps' spans",
}


def _check(name: str, value: Any) -> Any:
    if name == "paused":
        if isinstance(value, bool):
            return value
    elif name == "spans_every":
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
        return float(value)
    raise ConfigError(f"set({name}=...) takes {SETTINGS[name]}; got {value!r}")


def check_settings(options: dict[str, Any]) -> dict[str, Any]:
    """`options` checked against `SETTINGS` (names and values); a ConfigError naming the fix.

    >>> check_settings({"spans_every": 10})
    {'spans_every': 10}
    """
    unknown = sorted(set(options) - set(SETTINGS))
    if unknown:
        raise ConfigError(
            f"set() has no option {', '.join(map(repr, unknown))}; valid: {', '.join(SETTINGS)}"
        )
    if not options:
        raise ConfigError(f"set() needs at least one of {', '.join(SETTINGS)}")
    return {name: _check(name, value) for name, value in options.items()}
