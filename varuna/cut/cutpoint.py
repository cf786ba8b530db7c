"""`CutPoint`: the marker a user calls in `forward` wherever a pipeline stage may end.

Outside a Varuna engine a CutPoint is the identity, so an annotated model trains as before.
Inside the engine, the CutPoint that opens this rank's stage swaps in the activation received
from the previous stage, and the one that closes it hands the activation to the runtime and
ends the stage's forward there. Before its input CutPoint a stage runs only the glue between
modules, on stand-ins for the values other stages compute (`varuna.cut.standin`).

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

__all__ = ["CutPoint", "CutHandler", "handling", "model_loss"]


def model_loss(result: Any) -> Any:
    """The loss in what the model's forward returned: the result itself, or its ``loss`` (a
    transformers ``ModelOutput``, or a dict, when the batch holds labels)."""
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, dict) and "loss" in result:
        return result["loss"]
    loss = getattr(result, "loss", None)
    return result if loss is None else loss


class CutHandler(Protocol):
    """What decides each CutPoint call's result inside `handling`: the engine's stage, a profiler's clock."""

    def on_cut(self, cut: CutPoint, value: Any) -> Any: ...


_local = threading.local()


def _current_handler() -> CutHandler | None:
    return getattr(_local, "handler", None)


class handling:
    """Context manager installing the object that decides what each CutPoint call returns."""

    def __init__(self, handler: CutHandler) -> None:
        self.handler = handler

    def __enter__(self) -> CutHandler:
        self.previous = _current_handler()
        _local.handler = self.handler
        return self.handler

    def __exit__(self, *exc: object) -> None:
        _local.handler = self.previous


CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
"""Modules that hold blocks: a stage skips their blocks, never them, and no CutPoint is placed in one."""


class CutPoint(nn.Module):
    """A candidate boundary between pipeline stages; call it on the activation that crosses it.

    The value may be a tensor or a tuple of tensors. Values that a later stage needs and that
    are computed from the batch alone (attention masks, position ids) need not pass through a
    CutPoint: every stage receives the batch and recomputes them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.block: str | None = None
        """The block after which `auto_cut` placed this CutPoint (None: placed by hand)."""

    def forward(self, value: Any) -> Any:
        handler = _current_handler()
        if handler is None:
            return value
        return handler.on_cut(self, value)
