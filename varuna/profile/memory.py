"""What a model's stages hold in memory, found without allocating it: the engine's pre-flight check.

    segments = memory_segments(model, micro, trace, optimizer_bytes_per_param=8)
    per_stage = stage_memory(segments, tied, stages, mbs, recompute, inflight)   # varuna.planner.memory

Per segment (the code between two CutPoints): the bytes of its parameters, their gradients and
their optimizer state (a tied weight counted in its first segment), and the bytes its forward saves
for backward at this micro-batch size (saved-tensor hooks, parameters excluded, each storage once).
The forward runs on the meta device: a model built there is measured as it is, a real model through
meta copies of its parameters and buffers (`torch.func.functional_call`), so nothing of the size of
the model or its activations is allocated. The planner's per-stage estimate (`stage_memory`) turns
these into each stage's peak for a schedule, the same function `varuna plan` prices its candidates
with. The profiler (`varuna.profile.measure`) measures the same quantities on a real forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from varuna.cut.cutpoint import CutPoint, handling
from varuna.cut.partition import FollowMeta, Trace
from varuna.planner.costs import SegmentCost

__all__ = ["param_split", "memory_segments", "tensor_bytes", "MetaForwardError", "OPTIMIZER_STATE_BYTES"]

OPTIMIZER_STATE_BYTES = {"adam": 2, "momentum": 1, "none": 0}
"""Optimizer state per parameter, in parameters' worth of bytes (`EngineConfig.optimizer_state`)."""


class MetaForwardError(RuntimeError):
    """The model's forward does not run on the meta device (an op without a meta kernel, or one whose
    output shape depends on values, as a mixture of experts' routing): the activations cannot be
    measured there."""


def param_split(
    model: nn.Module, segment_of: Mapping[str, set[int]], segments: int, opt_per_param: float
) -> tuple[list[list[int]], int]:
    """[param, grad, optimizer] bytes per segment, and the bytes of parameters used in several.

    A parameter counts in the first segment that uses it (an unused one in segment 0, where the
    engine places it); `opt_per_param` is optimizer bytes per parameter element.
    """
    split = [[0] * segments for _ in range(3)]
    tied = 0
    for name, p in model.named_parameters():
        segs = segment_of.get(name) or {0}
        nbytes = p.numel() * p.element_size()
        split[0][min(segs)] += nbytes
        if p.requires_grad:
            split[1][min(segs)] += nbytes
            split[2][min(segs)] += int(p.numel() * opt_per_param)
        if len(segs) > 1:
            tied += nbytes
    return split, tied


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in `value` (a tensor, or any nest of lists, tuples and dicts of them)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


class _Segments:
    """CutPoint handler and saved-tensor hooks: bytes saved for backward per segment, and the
    bytes handed to each CutPoint."""

    def __init__(self, params: set[int], segments: int) -> None:
        self.params = params
        self.seen: set[int] = set()
        self.saved = [0] * segments
        self.cut_bytes = [0] * segments
        self.segment = 0

    def on_cut(self, cut: CutPoint, value: Any) -> Any:
        index = min(self.segment, len(self.cut_bytes) - 1)
        self.cut_bytes[index] = tensor_bytes(value)
        self.segment += 1
        return value

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            key, size = _storage_key(t)
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
            key, size = id(t), t.numel() * t.element_size()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.saved[min(self.segment, len(self.saved) - 1)] += size
        return t


def memory_segments(
    model: nn.Module,
    micro: Mapping[str, Any] | None,
    trace: Trace,
    *,
    optimizer_bytes_per_param: float = 8,
    autocast: Any = None,
) -> tuple[list[SegmentCost], int]:
    """Each segment's memory figures at `micro`'s batch size (times are 0: only memory is known),
    and the bytes of tied weights; one forward on the meta device (none without `micro`: then
    the activations are unknown and counted as 0)."""
    k = len(trace.cut_names)
    split, tied = param_split(model, trace.param_segments, k + 1, optimizer_bytes_per_param)
    segments = _Segments(set(), k + 1)
    if micro is not None:
        try:
            _saved_bytes(model, micro, segments, autocast)
        except (RuntimeError, NotImplementedError) as exc:  # an op with no meta kernel, or data-dependent
            raise MetaForwardError(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc
    mbs = _batch_len(micro) if micro is not None else 1
    return [
        SegmentCost(
            forward_s={mbs: 0.0},
            backward_s={mbs: 0.0},
            activation_bytes={mbs: segments.cut_bytes[j] if j < k else 0},
            activation_memory_bytes={mbs: segments.saved[j]},
            param_bytes=split[0][j],
            grad_bytes=split[1][j],
            optimizer_bytes=split[2][j],
        )
        for j in range(k + 1)
    ], tied


def _saved_bytes(model: nn.Module, micro: Mapping[str, Any], segments: _Segments, autocast: Any) -> None:
    """One forward with autograd on meta copies of the model's tensors, counting into `segments`."""
    named = {
        **{n: p for n, p in model.named_parameters(remove_duplicate=False)},
        **{n: b for n, b in model.named_buffers(remove_duplicate=False)},
    }
    shadows: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if id(t) not in shadows:
            shadow = torch.empty_like(t, device="meta")
            if isinstance(t, nn.Parameter):
                shadow.requires_grad_(t.requires_grad)
            shadows[id(t)] = shadow
        state[name] = shadows[id(t)]
    segments.params = {_storage_key(s)[0] for s in shadows.values()}
    # the batch stays real: values the model reads from it (a padding mask's `.all()`) are there, and
    # FollowMeta moves it to meta where it meets the meta parameters
    with (
        torch.compiler.set_stance("force_eager"),  # compiled blocks run as written: inductor has no meta
        FollowMeta(),
        handling(segments),
        torch.autograd.graph.saved_tensors_hooks(segments.pack, lambda t: t),
        autocast() if autocast is not None else contextlib.nullcontext(),
    ):
        torch.func.functional_call(model, state, args=(), kwargs=dict(micro), tie_weights=False, strict=False)


def _batch_len(micro: Mapping[str, Any]) -> int:
    for value in micro.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1
