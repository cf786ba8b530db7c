"""Mixed precision with torch.amp: the autocast policy and an fp16 loss scaler.

The scaler differs from `torch.amp.GradScaler` in one way that matters for pipelines: it never
decides alone. The engine all-reduces the overflow check over every stage and replica, then calls
`update(overflow)` with the same answer on every rank, so a step is skipped everywhere or nowhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Literal

import torch

from varuna.engine.config import PRECISIONS
from varuna.errors import ConfigError

__all__ = ["Precision", "PRECISIONS", "autocast_policy", "LossScaler"]

Precision = Literal["fp32", "bf16", "fp16"]


def autocast_policy(precision: str, device_type: str) -> Callable[[], AbstractContextManager[object]]:
    """A zero-argument factory of the context manager that forward (and recompute) run under."""
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "bf16":
        dtype = torch.bfloat16
    elif precision == "fp16":
        dtype = torch.float16
    else:
        raise ConfigError(f"precision={precision!r} is not one of {PRECISIONS}")
    return lambda: torch.autocast(device_type=device_type, dtype=dtype)


class LossScaler:
    """Dynamic loss scale for fp16: halve on overflow, double after `growth_interval` good steps."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        min_scale: float = 1.0,
    ) -> None:
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ConfigError(
                "LossScaler needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                f"growth_interval >= 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool) -> None:
        """Adjust the scale after a step; `overflow` must be the same on every rank."""
        if overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
