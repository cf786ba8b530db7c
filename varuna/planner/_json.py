"""Reading a cost table's JSON: integer keys (JSON makes them strings), required fields, and
per-size values, each with an error that names the field and the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from varuna.errors import ConfigError


def _int_keys(data: Mapping[Any, Any], what: str) -> dict[int, Any]:
    try:
        return {int(k): v for k, v in data.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what}: keys must be micro-batch sizes (integers), got {list(data)}") from exc


def _check_per_size(table: Mapping[int, float], what: str) -> None:
    for size, value in table.items():
        if not isinstance(size, int) or size < 1:
            raise ConfigError(f"{what}: micro-batch size {size!r} must be a positive integer")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{what}[{size}] = {value!r}; it must be a finite number >= 0")


def _field(data: Mapping[str, Any], name: str, what: str) -> Any:
    if name not in data:
        raise ConfigError(f"{what} is missing the field {name!r}; re-run `varuna profile` to write a new one")
    return data[name]
