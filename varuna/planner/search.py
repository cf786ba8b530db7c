"""The planner: every P x D x micro-batch size x schedule x recompute for N devices, ranked.

A pure function of a `CostTable` and the resources. For each shape with P x D == gpus it balances
the segments into P stages (`varuna.cut.partition.balance` on forward+backward time), simulates the
very action lists the runtime would execute (`varuna.planner.simulator`), estimates memory per stage, and
either ranks the configuration by predicted step time or says why it was rejected:

    result = plan(CostTable.load("runs/gpt/profile.json"), gpus=8, memory_bytes=parse_memory("16GiB"),
                  global_batch_size=32)
    best = result.ranked[0]           # Candidate(pipeline=4, data=2, micro_batch_size=2, ...)
    best.timeline.to_events()         # the predicted step, to draw over the measured one
    result.rejected[0].reason         # "out of memory: stage 0 needs 17.2 GiB > 16 GiB"

Time: the simulated step includes each stage's compute, transfers, gradient all-reduce (measured
at the job's world size where the profile has it), the per-step all-reduce and the parameter
update; on a host whose ranks share cores (`CostTable.compute_slowdown`) busy stages slow each other
down (`varuna.planner.simulator.Sharing`).

Memory per stage = parameters + gradients + optimizer state of its segments + the activations it
holds at its peak: the simulated peak number of micro-batches in flight (GPipe: M, 1F1B: min(P-s,
M), Varuna's pull-ahead may hold more) times one micro-batch's activations; with recompute only each
held micro-batch's stage input plus one micro-batch's full activations (the last stage never
recomputes, as in the runtime).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from varuna.cut.partition import balance
from varuna.errors import PlanError
from varuna.planner.chunked import chunked_misfit, price_chunked
from varuna.planner.costs import CostTable
from varuna.planner.memory import _memory, format_bytes, parse_memory
from varuna.planner.simulator import Sharing, StageCost, Timeline, simulate
from varuna.schedule import SCHEDULES, ScheduleName, build_schedule, schedule_spec

__all__ = [
    "PlanError",
    "Candidate",
    "Rejected",
    "PlanResult",
    "plan",
    "predict",
    "parse_memory",
    "format_bytes",
]

RejectKind = Literal["memory", "batch", "stages"]
_STEP_ALLREDUCE_BYTES = 64  # the per-step loss / overflow / stop-flag all-reduce


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
        head = (
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
        rows = [
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


def _stage_ranges(boundaries: Sequence[int], num_segments: int) -> list[range]:
    starts = [0, *(b + 1 for b in boundaries)]
    ends = [*(b + 1 for b in boundaries), num_segments]
    return [range(a, b) for a, b in zip(starts, ends)]


def _check_inputs(gpus: int, global_batch_size: int) -> None:
    if gpus < 1:
        raise PlanError(f"zero GPUs: gpus must be at least 1, got {gpus}; pass --gpus N with N >= 1")
    if global_batch_size < 1:
        raise PlanError(f"global_batch_size must be at least 1, got {global_batch_size}")


def plan(
    table: CostTable,
    *,
    gpus: int,
    memory_bytes: int | str,
    global_batch_size: int,
    schedules: Sequence[ScheduleName] | None = None,
    recompute_options: Sequence[bool] = (False, True),
    model_signature: str | None = None,
    micro_batch_sizes: Sequence[int] | None = None,
    pipelines: Sequence[int] | None = None,
) -> PlanResult:
    """Rank every configuration for `gpus` devices of `memory_bytes` (or "16GiB") each.

    See the module docstring for the model. With P=1 recompute changes nothing (the last stage never
    recomputes), so P=1 candidates carry recompute=False. Schedules that run the very same actions
    at a shape (at P=1, 1F1B and Varuna's: F B per micro-batch) are one candidate, under the first
    of `schedules` that gives it.

    `micro_batch_sizes` and `pipelines` restrict the search to those values (what a user fixed).

    Raises PlanError for zero GPUs, a table whose `model_signature` differs from the given one,
    unknown schedules, micro-batch sizes the table lacks, or when no configuration is left
    (saying which setting to change).
    """
    _check_inputs(gpus, global_batch_size)
    memory_bytes = parse_memory(memory_bytes)
    if model_signature is not None and model_signature != table.model_signature:
        raise PlanError(
            f"a profile from another model: the profile's model signature is {table.model_signature}, "
            f"this model's is {model_signature}; re-run `varuna profile` for this model"
        )
    if schedules is None:
        schedules = tuple(SCHEDULES)  # type: ignore[arg-type]
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise PlanError(f"unknown schedules {unknown or '(none given)'}; choose from {', '.join(SCHEDULES)}")
    sizes = list(table.micro_batch_sizes if micro_batch_sizes is None else micro_batch_sizes)
    missing = [m for m in sizes if m not in table.micro_batch_sizes]
    if missing or not sizes:
        raise PlanError(
            f"micro-batch sizes {missing or '(none given)'} are not in the profile (it has "
            f"{table.micro_batch_sizes}); profile them (`varuna profile --micro-batch-sizes ...`)"
        )
    depths = [p for p in range(1, gpus + 1) if gpus % p == 0]
    if pipelines is not None:
        wanted = set(pipelines)
        if not wanted & set(depths):
            raise PlanError(
                f"pipeline depths {sorted(wanted)} do not divide {gpus} GPUs (possible: {depths}); "
                "choose a data-parallel degree that divides the device count"
            )
        depths = [p for p in depths if p in wanted]
    ranked: list[Candidate] = []
    rejected: list[Rejected] = []
    n = table.num_segments
    for pipeline in depths:
        data = gpus // pipeline
        if pipeline > n:
            reason = f"P={pipeline} > {n} segments (add CutPoints to cut the model finer)"
            rejected.append(Rejected(pipeline=pipeline, data=data, kind="stages", reason=reason))
            continue
        for mbs in sizes:
            if global_batch_size % (data * mbs):
                reason = f"global batch {global_batch_size} not divisible by D x mbs = {data} x {mbs}"
                rejected.append(
                    Rejected(pipeline=pipeline, data=data, micro_batch_size=mbs, kind="batch", reason=reason)
                )
                continue
            seen: set[tuple[Any, ...]] = set()
            for schedule in schedules:
                misfit = (
                    chunked_misfit(table, schedule, pipeline, global_batch_size // (data * mbs))
                    if schedule_spec(schedule).chunks_per_rank > 1
                    else None
                )
                if misfit is not None:
                    rejected.append(
                        Rejected(
                            pipeline=pipeline, data=data, micro_batch_size=mbs, schedule=schedule,
                            kind="stages", reason=misfit,
                        )
                    )  # fmt: skip
                    continue
                for recompute in dict.fromkeys(bool(r) and pipeline > 1 for r in recompute_options):
                    same = _runs_as(schedule, pipeline, global_batch_size // (data * mbs), recompute)
                    if same in seen:
                        continue
                    seen.add(same)
                    cand = _evaluate(table, pipeline, data, mbs, schedule, recompute, global_batch_size)
                    need = cand.max_memory_bytes
                    if need <= memory_bytes:
                        ranked.append(cand)
                        continue
                    worst = cand.memory_per_stage_bytes.index(need)
                    reason = f"out of memory: stage {worst} needs {format_bytes(need)} > {format_bytes(memory_bytes)}"
                    rejected.append(
                        Rejected(
                            pipeline=pipeline,
                            data=data,
                            micro_batch_size=mbs,
                            schedule=schedule,
                            recompute=recompute,
                            kind="memory",
                            reason=reason,
                            memory_bytes=need,
                        )
                    )
    ranked.sort(key=lambda c: (c.predicted_step_s, c.max_memory_bytes, c.pipeline, -c.micro_batch_size))
    if not ranked:
        raise PlanError(_nothing_fits(rejected, gpus, memory_bytes, global_batch_size))
    return PlanResult(
        ranked=ranked,
        rejected=rejected,
        gpus=gpus,
        memory_bytes=memory_bytes,
        global_batch_size=global_batch_size,
    )


def _nothing_fits(rejected: list[Rejected], gpus: int, memory_bytes: int, global_batch_size: int) -> str:
    memory = [r for r in rejected if r.kind == "memory"]
    if memory:
        r = min(memory, key=lambda r: r.memory_bytes or 0)
        how = "with recompute" if r.recompute else "without recompute"
        return (
            f"nothing fits in {format_bytes(memory_bytes)} per device: the smallest requirement is "
            f"{format_bytes(r.memory_bytes or 0)} (P={r.pipeline}, D={r.data}, micro-batch size "
            f"{r.micro_batch_size}, {r.schedule} {how}); raise --memory to at least that, use more GPUs, "
            "or profile smaller micro-batch sizes"
        )
    reasons = "; ".join(dict.fromkeys(r.reason for r in rejected))
    return (
        f"no configuration for {gpus} GPUs and global batch {global_batch_size}: {reasons}; change the "
        "global batch size, the GPU count, or the micro-batch sizes profiled"
    )


def predict(
    table: CostTable,
    *,
    pipeline: int,
    data: int,
    micro_batch_size: int,
    schedule: ScheduleName,
    global_batch_size: int,
    recompute: bool = False,
    boundaries: Sequence[int] | None = None,
    split_backward: bool = True,
) -> Candidate:
    """The prediction for one configuration, e.g. the one a job runs (to draw its predicted timeline
    over the measured one). `boundaries` are its P-1 stage boundaries (CutPoint indices, as
    `engine.partition.boundaries`); None balances them as `plan` does; `split_backward` as the
    engine's option of that name. No memory limit applies.

    Raises PlanError for a shape the table or the batch cannot have.
    """
    _check_inputs(pipeline * data, global_batch_size)
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if micro_batch_size not in table.micro_batch_sizes:
        raise PlanError(
            f"micro-batch size {micro_batch_size} is not in the profile (it has {table.micro_batch_sizes}); "
            "profile it (`varuna profile --micro-batch-sizes ...`)"
        )
    if pipeline > table.num_segments:
        raise PlanError(
            f"P={pipeline} > {table.num_segments} segments (add CutPoints to cut the model finer)"
        )
    if global_batch_size % (data * micro_batch_size):
        raise PlanError(
            f"global batch {global_batch_size} not divisible by D x mbs = {data} x {micro_batch_size}"
        )
    if boundaries is not None:
        boundaries = tuple(int(b) for b in boundaries)
        cuts = table.num_segments - 1
        increasing = all(a < b for a, b in zip(boundaries, boundaries[1:]))
        if len(boundaries) != pipeline - 1 or not increasing or any(not 0 <= b < cuts for b in boundaries):
            raise PlanError(
                f"boundaries {list(boundaries)}: P={pipeline} needs {pipeline - 1} strictly increasing "
                f"CutPoint indices in 0..{cuts - 1}"
            )
    return _evaluate(
        table, pipeline, data, micro_batch_size, schedule, recompute and pipeline > 1, global_batch_size,
        boundaries, split_backward,
    )  # fmt: skip


def _runs_as(schedule: ScheduleName, pipeline: int, microbatches: int, recompute: bool) -> tuple[Any, ...]:
    """What the runtime does for `schedule` at a shape: its lowered action lists, and whether it
    pulls forwards ahead (Varuna's, with a stage to wait for)."""
    lowered = build_schedule(schedule, pipeline, microbatches, recompute=recompute)
    return (
        tuple(tuple(lowered[s]) for s in sorted(lowered)),
        schedule_spec(schedule).pull_ahead and pipeline > 1,
    )


def _evaluate(
    table: CostTable,
    pipeline: int,
    data: int,
    mbs: int,
    schedule: ScheduleName,
    recompute: bool,
    global_batch_size: int,
    boundaries: tuple[int, ...] | None = None,
    split_backward: bool = True,
) -> Candidate:
    segs = table.segments
    num_microbatches = global_batch_size // (data * mbs)
    if schedule_spec(schedule).chunks_per_rank > 1:  # P x V virtual stages (varuna.planner.chunked)
        priced = price_chunked(
            table, pipeline, data, mbs, schedule, recompute, global_batch_size, boundaries, split_backward
        )
        return Candidate(
            pipeline=pipeline,
            data=data,
            micro_batch_size=mbs,
            num_microbatches=num_microbatches,
            schedule=schedule,
            recompute=recompute,
            boundaries=priced.boundaries,
            predicted_step_s=priced.timeline.step_s,
            samples_per_s=global_batch_size / priced.timeline.step_s,
            bubble_fraction=priced.timeline.bubble_fraction,
            memory_per_stage_bytes=priced.memory_per_rank,
            timeline=priced.timeline,
        )
    if boundaries is None:
        boundaries = balance([s.forward_s[mbs] + s.backward_s[mbs] for s in segs], pipeline)
    stages = _stage_ranges(boundaries, len(segs))
    extra = table.action_overhead_s if pipeline > 1 else 0.0  # one stage: exactly the profiled pass
    costs = [
        StageCost(
            forward_s=sum(segs[j].forward_s[mbs] for j in r) + extra,
            backward_s=sum(segs[j].backward_s[mbs] for j in r) + extra,
            recompute_s=sum(segs[j].recompute_at(mbs) for j in r) + extra,
        )
        for r in stages
    ]
    net = table.network
    world = pipeline * data
    comm = [net.p2p_time(segs[r[-1]].activation_bytes[mbs]) for r in stages[:-1]]
    reduce = [net.allreduce_time(sum(segs[j].grad_bytes for j in r), data, world=world) for r in stages]
    update = [sum(segs[j].update_s for j in r) for r in stages]
    if pipeline > 1 and table.tied_bytes:
        tied = net.allreduce_time(table.tied_bytes, 2 * data, world=world)
        reduce[0] += tied
        reduce[-1] += tied
        # the last stage updates its own copy of the tied weights, at segment 0's cost per byte
        update[-1] += segs[0].update_s * table.tied_bytes / max(segs[0].param_bytes, 1)
    timeline = simulate(
        schedule,
        pipeline,
        num_microbatches,
        costs,
        comm=comm,
        allreduce_s=reduce,
        final_allreduce_s=net.allreduce_time(_STEP_ALLREDUCE_BYTES, world, world=world),
        update_s=update,
        sharing=Sharing(
            replicas=data,
            slowdown=table.compute_slowdown,
            delivery=net.delivery_s,
            message_cpu_s=[net.message_cpu_time(segs[r[-1]].activation_bytes[mbs]) for r in stages[:-1]],
        )
        if table.compute_slowdown or net.delivery_s
        else None,
        message_s=net.message_s,
        sees_arrivals=net.reports_arrival,
        recompute=recompute,
        split_backward=split_backward,
    )
    return Candidate(
        pipeline=pipeline,
        data=data,
        micro_batch_size=mbs,
        num_microbatches=num_microbatches,
        schedule=schedule,
        recompute=recompute,
        boundaries=boundaries,
        predicted_step_s=timeline.step_s,
        samples_per_s=global_batch_size / timeline.step_s if timeline.step_s > 0 else float("inf"),
        bubble_fraction=timeline.bubble_fraction,
        memory_per_stage_bytes=_memory(
            table, stages, mbs, recompute, timeline.peak_inflight, split_backward and pipeline > 1
        ),
        timeline=timeline,
    )
