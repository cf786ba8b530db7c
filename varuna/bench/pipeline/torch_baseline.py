"""torch.distributed.pipelining's side of the pipeline and network benchmarks: the bench GPT cut into
`PipelineStage`s at Varuna's boundaries, and a runner per schedule (`TorchRunner`), one pipeline or
D replicas of it.

Ranks sit as in Varuna: rank r is pipeline rank r % P of replica r // P. With D > 1 each replica's
stages talk over a process group of their own, each replica trains on its contiguous share of the
global batch, and after the schedule's step every rank all-reduces its stages' gradients with the
same stages of the other replicas (one flat buffer, averaged), before the optimizer step:

    replica 0: ranks 0 .. P-1   ──  pipeline group {0, .., P-1}
    replica 1: ranks P .. 2P-1  ──  pipeline group {P, .., 2P-1}
    stage group of pipeline rank s: {s, s+P, .., s+(D-1)P}   (the gradient all-reduce)

The all-reduce is not overlapped with the backward: torch.pipelining's schedule returns only when
its last backward is done.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from varuna.bench.common import LR, build_model
from varuna.errors import ConfigError
from varuna.models import GPT

__all__ = ["TorchRunner"]


def _units(n_layer: int, inside: bool) -> list[tuple[str, int]]:
    """The GPT's blocks as the pieces a stage boundary can fall between, in order: each block whole,
    or (with `cut_inside_blocks`) its attention half and its MLP half."""
    if not inside:
        return [("block", i) for i in range(n_layer)]
    return [(half, i) for i in range(n_layer) for half in ("attend", "feed")]


def _stage_units(boundaries: list[int], stage: int, units: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The units of `stage` under varuna's boundaries (cut c sits after unit c)."""
    first = boundaries[stage - 1] + 1 if stage > 0 else 0
    last = boundaries[stage] if stage < len(boundaries) else len(units) - 1
    return units[first : last + 1]


class _Stage(nn.Module):
    """One torch.pipelining stage cut from the GPT: the embedding on the first, then its units, and
    ln_f with the LM head on the last: the GPT's own head, or for a GPT that ties its head to the
    token embedding an untied copy of it (torch.pipelining has no weights shared across stages)."""

    def __init__(self, gpt: GPT, units: list[tuple[str, int]], *, first: bool, last: bool) -> None:
        super().__init__()
        self.units = units
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in sorted({i for _, i in units})})
        self.wte: nn.Embedding | None = gpt.wte if first else None
        self.wpe: nn.Embedding | None = gpt.wpe if first else None
        self.ln_f: nn.Module | None = None
        self.head: nn.Linear | None = None
        if last:
            self.ln_f = gpt.ln_f
            if gpt.lm_head is not None:
                self.head = gpt.lm_head
            else:
                self.head = nn.Linear(gpt.config.d_model, gpt.config.vocab_size, bias=False)
                with torch.no_grad():
                    self.head.weight.copy_(gpt.wte.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.wte is not None and self.wpe is not None:  # x is the input ids
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for kind, i in self.units:
            block = self.blocks[str(i)]
            x = block(x) if kind == "block" else getattr(block, kind)(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def _lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _groups(pipeline: int, data: int) -> tuple[Any, Any]:
    """(this rank's pipeline group, its stage group) of a P x D job; collective: every rank makes
    every group, in the same order."""
    import torch.distributed as dist

    rank = dist.get_rank()
    pipes = [dist.new_group([d * pipeline + s for s in range(pipeline)]) for d in range(data)]
    stages = [dist.new_group([d * pipeline + s for d in range(data)]) for s in range(pipeline)]
    return pipes[rank // pipeline], stages[rank % pipeline]


class TorchRunner:
    """One torch.distributed.pipelining stage of the spec's model (at the spec's boundaries) and
    schedule, with its own AdamW, in one of ``spec["data"]`` replicas (default 1) of a pipeline of
    ``spec["pipeline"]`` ranks; `step(batch)` takes the global batch and returns this replica's mean
    loss on its last stage (None elsewhere)."""

    def __init__(self, spec: dict[str, Any], name: str) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        from varuna.schedule import schedule_spec

        P, D, world = spec["pipeline"], spec.get("data", 1), dist.get_world_size()
        if P * D != world:
            raise ConfigError(
                f"torch.pipelining job has {world} ranks but the spec says pipeline={P} x data={D} "
                f"= {P * D}; give pipeline x data = the job's ranks"
            )
        B, mbs = spec["global_batch_size"], spec["micro_batch_size"]
        if B % (D * mbs):
            raise ConfigError(
                f"global batch {B} is not a multiple of data x micro_batch_size = {D} x {mbs}: "
                "each replica needs whole micro-batches"
            )
        self.rank, self.data = dist.get_rank(), D
        self.replica, self.share = self.rank // P, B // D
        self.stage_group: Any
        pipe_group, self.stage_group = _groups(P, D) if D > 1 else (None, None)
        # the virtual stages this rank holds, as Varuna places them (one per rank but for the
        # multi-chunk schedules: round-robin for interleaved-1f1b, a V for zb-v)
        sched = schedule_spec(name)
        n = P * sched.chunks_per_rank
        held = sched.stages_of(self.rank % P, P)
        self.first, self.last = 0 in held, n - 1 in held
        units = _units(spec["model"]["n_layer"], bool(spec["model"].get("cut_inside_blocks")))
        gpt = build_model(spec["model"])
        bounds = spec["boundaries_by_schedule"][name]
        self.modules = [
            _Stage(gpt, _stage_units(bounds, v, units), first=v == 0, last=v == n - 1) for v in held
        ]
        del gpt
        cpu = torch.device("cpu")
        stages: list[Any] = [
            PipelineStage(m, v, n, cpu, group=pipe_group) for m, v in zip(self.modules, held)
        ]
        M = self.share // mbs
        self.schedule: Any
        if name == "zb-h1":  # torch's ZB1P (ZB-H1) is its interleaved zero-bubble schedule on one stage
            self.schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=M, loss_fn=_lm_loss)
        elif name == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=_lm_loss)
        elif name == "zb-v":
            self.schedule = ScheduleZBVZeroBubble(stages, n_microbatches=M, loss_fn=_lm_loss)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
            self.schedule = kind(stages[0], n_microbatches=M, loss_fn=_lm_loss)
        # two chunks of a block cut inside it share its module: each parameter once
        params = {id(p): p for m in self.modules for p in m.parameters()}
        self.params = list(params.values())
        self.opt = torch.optim.AdamW(self.params, lr=LR)

    def step(self, batch: dict[str, Tensor]) -> float | None:
        mb_losses: list[Tensor] = []
        self.opt.zero_grad(set_to_none=True)
        if self.data > 1:  # this replica's contiguous share of the global batch
            lo = self.replica * self.share
            batch = {k: v[lo : lo + self.share] for k, v in batch.items()}
        args = (batch["input_ids"],) if self.first else ()
        if self.last:
            self.schedule.step(*args, target=batch["labels"], losses=mb_losses, return_outputs=False)
        else:
            self.schedule.step(*args)
        if self.data > 1:
            self._allreduce_grads()
        self.opt.step()
        return float(torch.stack(mb_losses).detach().mean()) if mb_losses else None

    def _allreduce_grads(self) -> None:
        """The mean of this rank's gradients over the replicas of its stages: one flat all-reduce.
        A parameter without a gradient (half of a block cut inside it, held whole) has none on
        every replica of the stage."""
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.stage_group)
        flat.div_(self.data)
        for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)
