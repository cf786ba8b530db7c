"""`CutPoint`: the marker a user calls in `forward` wherever a pipeline stage may end.

Outside a Varuna engine a CutPoint is the identity, so an annotated model trains as before.
Inside the engine, the CutPoint that opens this rank's stage swaps in the activation received
from the previous stage, and the one that closes it hands the activation to the runtime and
returns `SKIPPED`, a placeholder tensor that makes every later operation a no-op, so the rest
of the user's `forward` costs microseconds instead of another stage's compute.

    class GPT(nn.Module):
        def forward(self, input_ids, labels):
            x = self.embed(input_ids)
            for block, cut in zip(self.blocks, self.cuts):
                x = cut(block(x))           # stage boundaries may fall at any cut
            return self.loss(self.head(x), labels)
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["CutPoint", "SKIPPED", "is_skipped"]


class _Skipped(torch.Tensor):
    """A value computed by another stage: every torch operation on it returns it again."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return SKIPPED

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # pragma: no cover
        return "SKIPPED"


SKIPPED: torch.Tensor = torch.Tensor._make_subclass(_Skipped, torch.empty(0))
"""The placeholder for a value this rank does not compute."""


def is_skipped(value: Any) -> bool:
    """Whether `value` is (or contains) the placeholder of a value computed on another stage."""
    if isinstance(value, _Skipped):
        return True
    if isinstance(value, (tuple, list)):
        return any(is_skipped(v) for v in value)
    if isinstance(value, dict):
        return any(is_skipped(v) for v in value.values())
    return False


class _CutHandler(Protocol):
    def on_cut(self, cut: CutPoint, value: Any) -> Any: ...


_local = threading.local()


def _current_handler() -> _CutHandler | None:
    return getattr(_local, "handler", None)


class _handling:
    """Context manager installing the object that decides what each CutPoint call returns."""

    def __init__(self, handler: _CutHandler) -> None:
        self.handler = handler

    def __enter__(self) -> _CutHandler:
        self.previous = _current_handler()
        _local.handler = self.handler
        return self.handler

    def __exit__(self, *exc: object) -> None:
        _local.handler = self.previous


class CutPoint(nn.Module):
    """A candidate boundary between pipeline stages; call it on the activation that crosses it.

    The value may be a tensor or a tuple of tensors. Values that a later stage needs and that
    are computed from the batch alone (attention masks, position ids) need not pass through a
    CutPoint: every stage receives the batch and recomputes them.
    """

    def forward(self, value: Any) -> Any:
        handler = _current_handler()
        if handler is None:
            return value
        return handler.on_cut(self, value)
