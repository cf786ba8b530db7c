"""What the simulator is given and gives: one stage's costs (`StageCost`) and a predicted step
(`Timeline`). `varuna.planner.simulator` makes the timelines."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from varuna.schedule import WEIGHT_KIND, WORK_KINDS, Span

__all__ = ["StageCost", "Timeline", "measured_cost"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """Seconds one stage spends on one micro-batch (uniform over micro-batches)."""

    forward_s: float
    """Forward pass."""
    backward_s: float
    """Backward pass."""
    recompute_s: float | None = None
    """Recomputed forward before the backward; None means `forward_s`."""
    nograd_forward_s: float | None = None
    """The forward of a stage that recomputes (under `torch.no_grad()`: no graph, nothing kept);
    None means `forward_s`."""
    input_share: float = 0.65
    """A split backward's input half (B before its W), as a share of `backward_s`."""
    weight_share: float = 0.5
    """A split backward's weight half (W), as a share of `backward_s`. The two shares add up to more
    than 1: splitting costs a second pass over part of the graph. Both defaults are chosen against
    the engine's own B and W spans over its whole backward in a pipeline on a CPU host (the
    benchmark GPT's ZB-V chunks; docs/benchmarks/findings.md has the figures)."""

    def seconds(self, kind: str, *, split: bool = False, recomputes: bool = False) -> float:
        """The cost of a compute action of `kind` ("F", "B", "R" or "W"); `split`: a B whose
        weight half runs later as W; `recomputes`: an F of a stage that recomputes its forwards
        (it runs without autograd)."""
        if kind == "F":
            return (
                self.nograd_forward_s if recomputes and self.nograd_forward_s is not None else self.forward_s
            )
        if kind == "B":
            return self.backward_s * (self.input_share if split else 1.0)
        if kind == WEIGHT_KIND:
            return self.backward_s * self.weight_share
        return self.forward_s if self.recompute_s is None else self.recompute_s

    def order_costs(self, *, whole: bool = True) -> tuple[float, ...]:
        """(F, split B, W) seconds, and with `whole` the whole backward's: what an order fitted to
        the costs takes (`varuna.schedule.make_schedule(costs=)`)."""
        split = (self.seconds("F"), self.seconds("B", split=True), self.seconds("W"))
        return (*split, self.seconds("B")) if whole else split


def measured_cost(
    spans: Sequence[Mapping[str, Any]], *, unsplit_from_shares: bool = False
) -> StageCost | None:
    """A `StageCost` from one virtual stage's measured compute spans (dicts with "kind", "start",
    "end" and "mb"): the median F, B, W and R seconds; None without an F or a B. A B whose
    micro-batch has a W ran split (its input half): the split shares follow from the medians. Where
    every B ran split the whole backward was not seen: it is B + W, or with `unsplit_from_shares`
    (B + W) over the default shares' sum (a split costs that much more than a whole backward)."""

    def seconds(kind: str, split: bool | None = None) -> list[float]:
        return [
            float(sp["end"]) - float(sp["start"])
            for sp in spans
            if sp["kind"] == kind and (split is None or (sp.get("mb") in weights) == split)
        ]

    weights = {sp.get("mb") for sp in spans if sp["kind"] == WEIGHT_KIND}
    forward, whole, split = seconds("F"), seconds("B", False), seconds("B", True)
    if not forward or not (whole or split):
        return None
    b_split = statistics.median(split) if split else 0.0
    w = statistics.median(seconds(WEIGHT_KIND)) if weights else 0.0
    if whole:
        b = statistics.median(whole)
    else:
        shares = StageCost(forward_s=1.0, backward_s=1.0)  # the default shares
        b = (b_split + w) / (shares.input_share + shares.weight_share if unsplit_from_shares else 1.0)
    b = max(b, 1e-12)
    recompute = seconds("R")  # a recomputing stage: its F spans ran without autograd
    return StageCost(
        forward_s=statistics.median(forward),
        backward_s=b,
        recompute_s=statistics.median(recompute) if recompute else None,
        nograd_forward_s=statistics.median(forward) if recompute else None,
        **({"input_share": b_split / b, "weight_share": w / b} if split and weights else {}),
    )


@dataclass(kw_only=True, slots=True)
class Timeline:
    """A predicted step: what each stage does when, and where the time goes."""

    schedule: str
    """Schedule name ("gpipe", "1f1b", "varuna" or "custom")."""
    num_microbatches: int
    """Micro-batches per replica in the step."""
    spans: list[list[Span]]
    """Per stage, every executed action in execution order (sends as zero-length spans)."""
    step_s: float
    """Predicted step time: last stage's all-reduce end plus the final small all-reduce."""
    busy_s: list[float]
    """Per stage, seconds of compute (F, B, R)."""
    allreduce_s: list[float]
    """Per stage, seconds of its gradient all-reduce."""
    idle_s: list[float]
    """Per stage, the rest of the step: waiting for activations, gradients, other stages."""
    bubble_fraction: float
    """1 - total compute / (P x step_s)."""
    peak_inflight: list[int] = field(default_factory=list)
    """Per stage, the most micro-batches forwarded and not yet backwarded (for a split backward:
    not yet through its W) at once."""
    update_s: list[float] = field(default_factory=list)
    """Per stage, seconds of its parameter update after the final all-reduce (with shared cores)."""

    @property
    def num_stages(self) -> int:
        """Pipeline depth P."""
        return len(self.spans)

    def to_events(self, *, include_comm: bool = True) -> list[dict[str, Any]]:
        """The spans as plain dicts, for drawing the prediction over a measured timeline.

        One dict per action, ordered by stage then time:
        `{"stage": 1, "kind": "F", "microbatch": 0, "start": 0.5, "end": 1.5, "predicted": True}`.
        `kind` is the action kind (F, B, R, SEND_F, RECV_F, SEND_B, RECV_B, ALLREDUCE), as in the
        runtime's measured spans; times are seconds from the start of the step (align them with a
        measured step's start); `microbatch` is None for ALLREDUCE. `include_comm=False` keeps only
        compute and all-reduce spans.
        """
        return [
            {
                "stage": s,
                "kind": sp.kind,
                "microbatch": sp.microbatch,
                "start": sp.start,
                "end": sp.end,
                "predicted": True,
                **({"vstage": sp.stage} if sp.stage is not None else {}),
            }
            for s, spans in enumerate(self.spans)
            for sp in spans
            if include_comm or sp.kind in WORK_KINDS or sp.kind == "ALLREDUCE"
        ]
