"""The data-parallel gradient buckets: gradients as views into a few flat buffers, all-reduced, each
bucket as soon as its gradients are final.

Making `p.grad` a view of its bucket means backward accumulates straight into the buffer the
all-reduce sends: no copies in either direction. A step's all-reduce overlaps the pipeline's last
backward (as DDP's does): the runtime tells the buckets when a stage's last backward starts
(`final_pass`: each parameter then reports its last accumulation through a post-accumulate hook)
and when a stage has added its last weight gradient (`stage_done`); a bucket whose parameters are
all final starts its all-reduce at once. Buckets start in one fixed order on every rank, last
bucket first (the backward reaches the model's last parameters first), each only after the ones
before it in that order, because every rank of a group must issue its collectives in the same
order: a bucket that is ready waits for the ones ahead of it. `finish` (the schedule's ALLREDUCE
action) starts whatever has not started.

With `dtype=torch.bfloat16` a bucket is all-reduced as a bfloat16 copy (half the bytes on the
wire) and the mean is copied back into the fp32 buffer: the gradients then differ from plain
training's by bfloat16's rounding of each replica's share, so training is no longer equal to one
process bit for bit (it is with the default, the gradients' own dtype).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradBuckets"]


class _Reduced:
    """A started all-reduce of a low-precision copy: waiting for it copies the mean back."""

    def __init__(self, work: Any, low: torch.Tensor, flat: torch.Tensor) -> None:
        self.work, self.low, self.flat = work, low, flat

    def wait(self) -> None:
        self.work.wait()
        self.flat.copy_(self.low)


class GradBuckets:
    """Gradients as views into a few flat buffers, all-reduced (averaged) bucket by bucket.

    `stages` maps each parameter's id to the (virtual) stage that computes its gradient, for
    `final_pass` and `stage_done`; without it every parameter is of stage 0. Buckets hold at most
    `bucket_bytes` (a larger parameter gets one of its own), the first one all-reduced (the last
    parameters') at most `first_bucket_bytes` where that is smaller.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        bucket_bytes: int = 25 * 2**20,
        *,
        stages: Mapping[int, int] | None = None,
        dtype: torch.dtype | None = None,
        first_bucket_bytes: int = 2**20,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.buffers: list[torch.Tensor] = []
        self.members: list[list[torch.nn.Parameter]] = []
        self.dtype = dtype
        self._views: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        # filled from the last parameter back, as DDP's: the bucket all-reduced first holds the
        # parameters the backward reaches first, and is small (`first_bucket_bytes`) so that its
        # all-reduce starts early in the last backward and runs beside the rest of it
        buckets: list[list[torch.nn.Parameter]] = []
        bucket: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            cap = min(first_bucket_bytes, bucket_bytes) if not buckets else bucket_bytes
            if bucket and (size + p.numel() * p.element_size() > cap or p.dtype != bucket[0].dtype):
                buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += p.numel() * p.element_size()
        if bucket:
            buckets.append(bucket)
        for members in reversed(buckets):  # in the parameters' order: the last bucket starts first
            self._add_bucket(members[::-1])
        self._bucket_of = {id(p): b for b, members in enumerate(self.members) for p in members}
        self._stage_params: dict[int, list[torch.nn.Parameter]] = {}
        for p in self.params:
            self._stage_params.setdefault((stages or {}).get(id(p), 0), []).append(p)
        self._group: Any = None
        self._world = 1
        self._waiting = [0] * len(self.members)  # per bucket: parameters not final yet this step
        self._final: set[int] = set()  # ids of this step's final parameters
        self._next = len(self.members) - 1  # the next bucket to start, in the fixed order
        self.works: list[Any] = []
        self.started_early = 0
        """Buckets of the last step started before the schedule's ALLREDUCE (overlapped)."""
        self.started_in_backward = 0
        """Of those, the buckets started inside a backward, by its last parameter's accumulation."""

    def _add_bucket(self, params: list[torch.nn.Parameter]) -> None:
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:
            self._views.append((p, flat[offset : offset + p.numel()].view_as(p)))
            offset += p.numel()
        self.buffers.append(flat)
        self.members.append(params)

    def zero_and_attach(self) -> None:
        """Zero the buffers and point every parameter's .grad at its view (undoing zero_grad(None))."""
        for flat in self.buffers:
            flat.zero_()
        for p, view in self._views:
            if p.grad is not view:
                p.grad = view

    # one step --------------------------------------------------------------------------------
    def begin_step(self, group: Any, world: int) -> None:
        """Start a step whose buckets are averaged over `group` (`world` ranks); None: no all-reduce
        (one replica), and the calls below do nothing."""
        self._group, self._world = group, world
        self._waiting = [len(members) for members in self.members]
        self._final.clear()
        self._next = len(self.members) - 1
        self.works = []
        self.started_early = self.started_in_backward = 0

    @contextmanager
    def final_pass(self, stage: int) -> Any:
        """Around the last backward that adds to `stage`'s weight gradients this step (a whole
        backward through autograd): each of its parameters is final once its gradient is accumulated."""
        if self._group is None:
            yield
            return
        handles = [
            p.register_post_accumulate_grad_hook(self._accumulated)
            for p in self._stage_params.get(stage, [])
            if id(p) not in self._final
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _accumulated(self, p: torch.Tensor) -> None:
        self._mark(p)
        started = self.started_early
        self._start_ready(early=True)
        self.started_in_backward += self.started_early - started

    def stage_done(self, stage: int) -> None:
        """`stage` has added its last weight gradient of the step: its parameters are final."""
        if self._group is None:
            return
        for p in self._stage_params.get(stage, []):
            self._mark(p)
        self._start_ready(early=True)

    def finish(self) -> list[Any]:
        """Start every bucket not started yet; returns the step's works to wait for."""
        if self._group is not None:
            for p in self.params:
                self._mark(p)
            self._start_ready(early=False)
        return self.works

    def _mark(self, p: torch.Tensor) -> None:
        if id(p) not in self._final:
            self._final.add(id(p))
            self._waiting[self._bucket_of[id(p)]] -= 1

    def _start_ready(self, *, early: bool) -> None:
        while self._next >= 0 and self._waiting[self._next] == 0:
            self.works.append(self._start(self.buffers[self._next]))
            self.started_early += early
            self._next -= 1

    def _start(self, flat: torch.Tensor) -> Any:
        if self.dtype is not None and self.dtype != flat.dtype:
            low = flat.to(self.dtype).div_(self._world)
            return _Reduced(dist.all_reduce(low, group=self._group, async_op=True), low, flat)
        flat.div_(self._world)
        return dist.all_reduce(flat, group=self._group, async_op=True)
