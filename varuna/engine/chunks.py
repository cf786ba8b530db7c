"""Several model chunks on one rank (interleaved and V schedules): each chunk's forward runs only
its own modules.

With one chunk per rank, the modules of other stages hold meta parameters and return stand-ins
(`varuna.engine.stage.strip`); the forward ends at the chunk's last CutPoint. With two chunks the
modules of the rank's *other* chunk are real, and a forward of the later chunk would run the
earlier chunk's modules again on the way to its input CutPoint. `guard_chunks` gives every module
that holds only real parameters a forward that returns stand-ins (as `SkippedForward` does) while
the running forward has not reached its chunk's input CutPoint, and runs the module otherwise. A
module that holds CutPoints too (a block with one inside, as the bench GPT's) is skipped whole where
all its CutPoints come before the running chunk's input CutPoint, and entered otherwise (its children
guarded in turn): one stand-in call per block on the way, not one per operation of its glue.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from varuna.cut.cutpoint import CONTAINERS, CutPoint
from varuna.cut.standin import SkippedForward

__all__ = ["guard_chunks", "ChunkGuard"]


class ChunkGuard:
    """A module's forward that is skipped (stand-ins) while `before_start()` says so.

    A skipped call whose input shapes the start-up trace did not see infers the output's shape on
    the meta device, as `SkippedForward` does; this module's parameters are real (its chunk runs
    here), so that inference runs it with meta copies of them (`torch.func.functional_call`)."""

    def __init__(
        self,
        module: nn.Module,
        name: str,
        device: torch.device,
        traced: dict[Any, Any] | None,
        before_start: Callable[[], bool],
    ) -> None:
        self.run: Callable[..., Any] = module.forward
        self.module = module
        self.skip = SkippedForward(module, name, device, traced)
        self.skip.forward = self._on_meta
        self.before_start = before_start
        self._inferring = False

    def _on_meta(self, *args: Any, **kwargs: Any) -> Any:
        state = {
            n: torch.empty_like(t, device="meta")
            for n, t in (*self.module.named_parameters(), *self.module.named_buffers())
        }
        self._inferring = True
        try:
            return torch.func.functional_call(self.module, state, args, kwargs)
        finally:
            self._inferring = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before_start() and not self._inferring:
            return self.skip(*args, **kwargs)
        return self.run(*args, **kwargs)


def guard_chunks(
    model: nn.Module,
    device: torch.device,
    traced: Mapping[str, Any],
    before: Callable[[int | None], bool],
    cut_index: Mapping[int, int],
) -> int:
    """Guard the outermost modules whose parameters are all real; returns how many. `before(last)`:
    whether the running forward has not reached its chunk's input CutPoint, and that CutPoint comes
    after index `last` (a module's last CutPoint; None for a module without one). A module holding
    CutPoints is guarded too (skipped whole only before a chunk that starts after all of them) and
    its children in turn, for the forwards that enter it."""
    guarded = 0

    def visit(name: str, module: nn.Module) -> None:
        nonlocal guarded
        params = list(module.parameters())
        if not params or all(p.is_meta for p in params) or isinstance(module, CutPoint):
            return  # glue runs everywhere; a stripped module already returns stand-ins
        whole = not isinstance(module, CONTAINERS) and not any(p.is_meta for p in params)
        cuts = [
            cut_index[id(sub)]
            for sub in module.modules()
            if isinstance(sub, CutPoint) and id(sub) in cut_index
        ]
        if whole:
            last = max(cuts) if cuts else None
            guard = ChunkGuard(module, name, device, traced.get(name), functools.partial(before, last))
            module.forward = guard  # type: ignore[method-assign]
            guarded += 1
            if not cuts:
                return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return guarded
