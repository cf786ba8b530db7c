"""A NaN or Inf is never trained on silently: where it appeared, found once a step has one.

Every step's small all-reduce already carries the loss and the gradients' squared norm; when either
is not finite (fp32, bf16; fp16's loss scaler skips such steps itself) the step stops before the
optimizer and every rank, together, looks for the origin (`diagnose`, collective):

    forward    each rank replays the step's micro-batches forwards only (no gradients, the random
               state forked, so training is not disturbed) with a hook on every module it runs:
               the origin is the first module whose output holds a NaN or Inf while its inputs
               did not. The earliest stage with such a module wins (a value it sends spreads
               to the later ones).
    backward   the forward is finite everywhere: the parameters whose gradients are not finite,
               on the latest stage holding any (backward runs from the last stage to the first).

`EngineConfig.on_nonfinite` = "raise" (a `NonFiniteError` naming the step, the stage, the module
and what to change) or "skip" (the update is skipped, counted in `engine.nonfinite_steps`, logged).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from varuna.cut.standin import StandIn
from varuna.errors import VarunaError

__all__ = ["NonFiniteError", "Origin", "diagnose", "describe"]

log = logging.getLogger("varuna")


class NonFiniteError(VarunaError, FloatingPointError):
    """A step's loss or gradients hold NaN or Inf: raised before the optimizer touches anything."""


@dataclass(slots=True)
class Origin:
    """Where a non-finite value first appeared."""

    stage: int
    rank: int
    where: str
    """"forward": `module` produced it from finite inputs; "backward": `params` got such gradients."""
    module: str = ""
    microbatch: int | None = None
    params: tuple[str, ...] = ()


def _finite(value: Any) -> bool:
    for t in tree_leaves(value):
        if (
            isinstance(t, torch.Tensor)
            and not isinstance(t, StandIn)
            and not t.is_meta
            and t.is_floating_point()
        ):
            if not bool(torch.isfinite(t).all()):
                return False
    return True


class _FirstBad:
    """Forward hooks: the first module (in call order) whose output is not finite and whose inputs are."""

    def __init__(self, model: nn.Module) -> None:
        self.found: tuple[str, int] | None = None
        self.microbatch = 0
        self.handles = [
            module.register_forward_hook(self._hook(name or type(model).__name__), with_kwargs=True)
            for name, module in model.named_modules()
        ]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if self.found is None and not _finite(output) and _finite((args, kwargs)):
                self.found = (name, self.microbatch)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def diagnose(engine: Any, micro: Sequence[Mapping[str, Any]]) -> Origin | None:
    """Collective: where this step's non-finite value came from (see the module docstring)."""
    model: nn.Module = engine.model
    hooks = _FirstBad(model)
    device = engine.device
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():

            def seen(m: int, loss: torch.Tensor, result: Any) -> None:
                if hooks.found is None and not bool(torch.isfinite(loss).all()):
                    hooks.found = ("the loss the model's forward returns", m)

            class _Counting(list):  # tells the hooks which micro-batch runs
                def __getitem__(self, m: Any) -> Any:
                    if isinstance(m, int):
                        hooks.microbatch = m
                    return super().__getitem__(m)

            engine._runtime.evaluate(engine._eval_actions(len(micro)), _Counting(micro), seen)
    finally:
        hooks.remove()
        engine._eval_done()
    forward = None if hooks.found is None else (engine.stage, engine.rank, hooks.found[0], hooks.found[1])
    bad = tuple(
        n
        for n, p in engine.named_parameters()
        if p.grad is not None and not bool(torch.isfinite(p.grad).all())
    )
    mine = (forward, (engine.stage, engine.rank, bad))
    found: list[Any] = [mine]
    if engine.world_size > 1:
        found = [None] * engine.world_size
        dist.all_gather_object(found, mine)
    forwards = sorted(f for f, _ in found if f is not None)
    if forwards:
        stage, rank, module, mb = forwards[0]
        return Origin(stage=stage, rank=rank, where="forward", module=module, microbatch=mb)
    backwards = sorted((b for _, b in found if b[2]), reverse=True)
    if backwards:
        stage, rank, params = backwards[0]
        return Origin(stage=stage, rank=rank, where="backward", params=params)
    return None


def describe(step: int, loss: float, grad_sq: float, origin: Origin | None) -> str:
    """The error's message: what is not finite, where it came from, what to change."""
    what = []
    if not _is_finite(loss):
        what.append(f"the loss is {loss}")
    if not _is_finite(grad_sq):
        what.append("the gradients hold NaN or Inf")
    head = f"step {step}: {' and '.join(what) or 'a value is not finite'}"
    if origin is None:
        place = "; no stage found its origin on replaying the step (a random draw that did not repeat?)"
    elif origin.where == "forward":
        place = (
            f"; it first appears in the forward of stage {origin.stage} (rank {origin.rank}), micro-batch "
            f"{origin.microbatch}, at module {origin.module!r}, whose inputs were finite"
        )
    else:
        more = f" (and {len(origin.params) - 3} more)" if len(origin.params) > 3 else ""
        place = (
            f"; the forward is finite, and the backward first gives non-finite gradients on stage "
            f"{origin.stage} (rank {origin.rank}): {', '.join(origin.params[:3])}{more}"
        )
    return (
        f"{head}{place}. Nothing was updated. Lower the learning rate, clip gradients (clip_grad_norm=...), "
        "check that batch's data, or pass on_nonfinite='skip' to skip such updates and count them"
    )


def _is_finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))


def note_skip(step: int, loss: float, grad_sq: float, where: str) -> None:
    gradients = "finite" if _is_finite(grad_sq) else "not finite"
    log.warning(
        "varuna: %s: step %d skipped (on_nonfinite='skip'): loss %s, gradients %s",
        where,
        step,
        loss,
        gradients,
    )
