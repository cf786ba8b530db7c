"""The data-parallel gradient buckets: gradients as views into a few flat buffers, all-reduced."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradBuckets"]


class GradBuckets:
    """Gradients as views into a few flat buffers, all-reduced (averaged) bucket by bucket.

    Making `p.grad` a view of the bucket means backward accumulates straight into the buffer the
    all-reduce sends: no copies in either direction.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], bucket_bytes: int = 25 * 2**20) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for p in self.params:
            if bucket and (size + p.numel() * p.element_size() > bucket_bytes or p.dtype != bucket[0].dtype):
                self._add_bucket(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel() * p.element_size()
        if bucket:
            self._add_bucket(bucket)

    def _add_bucket(self, params: list[torch.nn.Parameter]) -> None:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            self._views.append((p, flat[offset : offset + p.numel()].view_as(p)))
            offset += p.numel()
        self.buffers.append(flat)

    def zero_and_attach(self) -> None:
        """Zero the buffers and point every parameter's .grad at its view (undoing zero_grad(None))."""
        for flat in self.buffers:
            flat.zero_()
        for p, view in self._views:
            if p.grad is not view:
                p.grad = view

    def allreduce_mean(self, group: Any, world: int) -> list[Any]:
        """Start the averaging all-reduce of every bucket; returns the works to wait for."""
        works = []
        for flat in self.buffers:
            flat.div_(world)
            works.append(dist.all_reduce(flat, group=group, async_op=True))
        return works
