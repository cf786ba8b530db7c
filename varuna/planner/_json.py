"""Reading a cost table's JSON: integer keys (JSON makes them strings), required fields, and
per-size values, each with an error that names the field and the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from varuna.errors import ConfigError

__all__ = ["int_keys", "check_per_size", "required_field"]


def int_keys(data: Mapping[Any, Any], what: str) -> dict[int, Any]:
    """`data` with its keys (micro-batch or group sizes, strings in JSON) as integers."""
    try:
        return {int(k): v for k, v in data.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: keys must be micro-batch sizes (integers), got {list(data)}") from exc


def check_per_size(table: Mapping[int, float], what: str) -> None:
    """ConfigError unless every key is a positive micro-batch size and every value finite and >= 0."""
    for size, value in table.items():
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"{what}: micro-batch size {size!r} must be a positive integer")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{what}[{size}] = {value!r}; it must be a finite number >= 0")


def required_field(data: Mapping[str, Any], name: str, what: str) -> Any:
    """`data[name]`; ConfigError naming `what` and the fix (profile again) when it is missing."""
    if name not in data:
        raise ConfigError(f"{what} is missing the field {name!r}; re-run `varuna profile` to write a new one")
    return data[name]
