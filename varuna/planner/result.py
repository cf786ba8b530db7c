"""What the planner answers: the configurations that fit, ranked (`Candidate`), the ones ruled out
with their reasons (`Rejected`), and both together (`PlanResult`, which `varuna plan` prints)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from varuna.planner.memory import format_bytes
from varuna.planner.simulator import Timeline
from varuna.schedule import ScheduleName

__all__ = ["Candidate", "Rejected", "PlanResult", "RejectKind"]

RejectKind = Literal["memory", "batch", "stages"]


@dataclass(kw_only=True, slots=True)
class Candidate:
    """One configuration that fits, with its prediction."""

    pipeline: int
    """Pipeline depth P (stages)."""
    data: int
    """Data-parallel replicas D."""
    micro_batch_size: int
    """Samples per micro-batch."""
    num_microbatches: int
    """Micro-batches per replica per step, M = global batch / (D x mbs)."""
    schedule: ScheduleName
    """"gpipe", "1f1b" or "varuna"."""
    recompute: bool
    """Whether non-last stages recompute activations before the backward."""
    boundaries: tuple[int, ...]
    """The P-1 CutPoint indices ending stages 0..P-2 (`Varuna(partition=...)`)."""
    predicted_step_s: float
    """Simulated seconds per step."""
    samples_per_s: float
    """Global batch / predicted step time."""
    bubble_fraction: float
    """Simulated idle fraction of the step."""
    memory_per_stage_bytes: list[int]
    """Estimated peak bytes on each stage's device."""
    timeline: Timeline = field(repr=False)
    """The simulated step, for drawing."""
    placement: str | None = None
    """How the ranks sit on hosts (`varuna.planner.cluster.Cluster.placement`); None: one host."""

    @property
    def max_memory_bytes(self) -> int:
        """The largest per-device requirement."""
        return max(self.memory_per_stage_bytes)

    def to_json(self, *, include_timeline: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; `include_timeline` adds the predicted spans (`Timeline.to_events`)."""
        out: dict[str, Any] = {
            "pipeline": self.pipeline,
            "data": self.data,
            "micro_batch_size": self.micro_batch_size,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "recompute": self.recompute,
            "boundaries": list(self.boundaries),
            "predicted_step_s": self.predicted_step_s,
            "samples_per_s": self.samples_per_s,
            "bubble_fraction": self.bubble_fraction,
            "memory_per_stage_bytes": list(self.memory_per_stage_bytes),
            "placement": self.placement,
        }
        if include_timeline:
            out["timeline"] = self.timeline.to_events()
        return out


@dataclass(kw_only=True, slots=True)
class Rejected:
    """A configuration the planner ruled out; None fields mean "every value" (e.g. every schedule)."""

    pipeline: int
    data: int
    micro_batch_size: int | None = None
    schedule: ScheduleName | None = None
    recompute: bool | None = None
    kind: RejectKind
    """"memory" (does not fit), "batch" (global batch not divisible), "stages" (P > segments)."""
    reason: str
    """What ruled it out, e.g. "out of memory: stage 1 needs 17.2 GiB > 16.0 GiB"."""
    memory_bytes: int | None = None
    """For "memory": the largest per-stage requirement."""
    memory_at_least: bool = False
    """For "memory": `memory_bytes` is a lower bound (rejected before simulating, see
    `varuna.planner.fast`)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            k: getattr(self, k)
            for k in ("pipeline", "data", "micro_batch_size", "schedule", "recompute", "kind", "reason")
        }


@dataclass(kw_only=True, slots=True)
class PlanResult:
    """Ranked candidates (best first) and the rejected configurations with their reasons."""

    ranked: list[Candidate]
    rejected: list[Rejected]
    gpus: int
    memory_bytes: int
    global_batch_size: int

    @property
    def best(self) -> Candidate:
        """The configuration with the shortest predicted step."""
        return self.ranked[0]

    def to_json(self, *, top: int | None = None) -> dict[str, Any]:
        """A JSON-ready dict: the inputs, the first `top` ranked candidates and all rejections."""
        return {
            "gpus": self.gpus,
            "memory_bytes": self.memory_bytes,
            "global_batch_size": self.global_batch_size,
            "ranked": [c.to_json() for c in self.ranked[:top]],
            "rejected": [r.to_json() for r in self.rejected],
        }

    def format(self, *, top: int = 10) -> str:
        """The ranked table and the rejections grouped by kind, as `varuna plan` prints them."""
        head: tuple[str, ...] = (
            "#",
            "P",
            "D",
            "mbs",
            "M",
            "schedule",
            "recompute",
            "step s",
            "samples/s",
            "bubble",
            "max mem",
        )
        rows: list[tuple[str, ...]] = [
            (
                str(i + 1),
                str(c.pipeline),
                str(c.data),
                str(c.micro_batch_size),
                str(c.num_microbatches),
                c.schedule,
                "yes" if c.recompute else "no",
                f"{c.predicted_step_s:.4g}",
                f"{c.samples_per_s:.4g}",
                f"{100 * c.bubble_fraction:.1f}%",
                format_bytes(c.max_memory_bytes),
            )
            for i, c in enumerate(self.ranked[:top])
        ]
        if any(c.placement for c in self.ranked[:top]):  # GPUs on several hosts: how ranks sit on them
            head = (*head, "placement")
            rows = [(*row, c.placement or "-") for row, c in zip(rows, self.ranked[:top])]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        lines = [
            f"{len(self.ranked)} configurations fit {self.gpus} devices of {format_bytes(self.memory_bytes)} "
            f"(global batch {self.global_batch_size}); best first:"
        ]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in [head, *rows]]
        if len(self.ranked) > top:
            lines.append(f"... and {len(self.ranked) - top} more (--top N shows more)")
        if self.rejected:
            lines.append(f"{len(self.rejected)} rejected:")
            for kind, label in (
                ("memory", "out of memory"),
                ("batch", "batch"),
                ("stages", "too many stages"),
            ):
                group = [r for r in self.rejected if r.kind == kind]
                if group:
                    lines.append(f"  {len(group)} {label}, e.g. P={group[0].pipeline}: {group[0].reason}")
        return "\n".join(lines)
