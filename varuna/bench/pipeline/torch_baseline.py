"""torch.distributed.pipelining's side of the pipeline benchmark: the bench GPT cut into
`PipelineStage`s at Varuna's boundaries, and a runner per schedule (`TorchRunner`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from varuna.bench.common import LR, build_model
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


class TorchRunner:
    """One torch.distributed.pipelining stage of the spec's model (at the spec's boundaries) and
    schedule, with its own AdamW; `step(batch)` returns the mean loss on the last stage."""

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

        self.rank, P = dist.get_rank(), dist.get_world_size()
        if P != spec["pipeline"]:
            raise RuntimeError(
                f"torch.pipelining job has {P} ranks but the spec says pipeline={spec['pipeline']}"
            )
        # the virtual stages this rank holds, as Varuna places them (one per rank but for the
        # multi-chunk schedules: round-robin for interleaved-1f1b, a V for zb-v)
        sched = schedule_spec(name)
        n = P * sched.chunks_per_rank
        held = sched.stages_of(self.rank, P)
        self.first, self.last = 0 in held, n - 1 in held
        units = _units(spec["model"]["n_layer"], bool(spec["model"].get("cut_inside_blocks")))
        gpt = build_model(spec["model"])
        bounds = spec["boundaries_by_schedule"][name]
        self.modules = [
            _Stage(gpt, _stage_units(bounds, v, units), first=v == 0, last=v == n - 1) for v in held
        ]
        del gpt
        stages: list[Any] = [PipelineStage(m, v, n, torch.device("cpu")) for m, v in zip(self.modules, held)]
        M = spec["global_batch_size"] // spec["micro_batch_size"]
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
        self.opt = torch.optim.AdamW(list(params.values()), lr=LR)

    def step(self, batch: dict[str, Tensor]) -> float | None:
        mb_losses: list[Tensor] = []
        self.opt.zero_grad(set_to_none=True)
        args = (batch["input_ids"],) if self.first else ()
        if self.last:
            self.schedule.step(*args, target=batch["labels"], losses=mb_losses, return_outputs=False)
        else:
            self.schedule.step(*args)
        self.opt.step()
        return float(torch.stack(mb_losses).detach().mean()) if mb_losses else None
