"""Passes over a user's model for measuring it: micro-batches cut from its example batch, on the
model's device, with the model's gradients and RNG streams left as they were.

Shared by the per-segment profile (`varuna.profile.measure`) and the compute slowdown (`varuna.profile.slowdown`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from varuna.errors import ConfigError

__all__ = ["micro_len", "micro_batch", "device_of", "preserved"]


def micro_len(batch: Mapping[str, Any]) -> int:
    """The batch dimension its tensors share; ConfigError when they differ or there are none."""
    lengths = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not lengths or len(set(lengths.values())) > 1:
        raise ConfigError(
            f"example_batch must be a dict of tensors sharing the batch dimension (got {lengths or 'none'})"
        )
    return next(iter(lengths.values()))


def micro_batch(batch: Mapping[str, Any], size: int, device: torch.device) -> dict[str, Any]:
    """The first `size` rows of `batch` (rows repeat cyclically if it has fewer), on `device`."""
    n = micro_len(batch)
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            v = v[:size] if size <= n else v.index_select(0, torch.arange(size, device=v.device) % n)
            v = v.to(device)
        out[k] = v
    return out


def device_of(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Leave the model's gradients and the RNG streams as they were (profiling draws dropout masks)."""
    grads = {p: p.grad for p in model.parameters()}
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with torch.enable_grad():
            yield
    finally:
        for p, g in grads.items():
            p.grad = g
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
