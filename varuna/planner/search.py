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

At scale (`cluster`: hosts of several GPUs, `varuna.planner.cluster`) transfers and all-reduces
that leave a host cost the network between hosts. A crossing carries activations one way and
gradients the other; where the profile measured how much a link slows while both directions carry
streams (`Cluster.duplex`), a step is simulated twice: the second time each crossing's transfers
take the duplex factor for the share of the first step that the opposite direction was busy (M
transfers of its busy time: each direction carries the same bytes). The search stays fast where it
provably gives the same answer (`varuna.planner.fast`): each schedule's action lists are built
once, stage boundaries and costs once per (P, micro-batch size), a configuration whose memory
exceeds the limit already in its list order is rejected without simulating it, and schedules
without pull-ahead are timed stage by stage. `fast=False` simulates everything event by event (the reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from varuna.cut.partition import balance
from varuna.errors import PlanError
from varuna.planner.chunked import chunked_candidate, chunked_misfit
from varuna.planner.cluster import PLACEMENTS, Cluster, Links, Placement
from varuna.planner.costs import STEP_ALLREDUCE_BYTES, CostTable
from varuna.planner.fast import inflight_in_order, lowered
from varuna.planner.memory import format_bytes, parse_memory, stage_memory
from varuna.planner.result import Candidate, PlanResult, Rejected
from varuna.planner.simulator import Sharing, StageCost, simulate_lowered
from varuna.planner.timeline import Timeline
from varuna.schedule import SCHEDULES, Schedule, ScheduleName, schedule_spec

__all__ = [
    "PlanError",
    "Candidate",
    "Rejected",
    "PlanResult",
    "Cluster",
    "plan",
    "predict",
    "parse_memory",
    "format_bytes",
    "runs_as",
]


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
    cluster: Cluster | None = None,
    fast: bool = True,
    placements: Sequence[Placement] | None = None,
) -> PlanResult:
    """Rank every configuration for `gpus` devices of `memory_bytes` (or "16GiB") each.

    See the module docstring for the model. With P=1 recompute changes nothing (the last stage never
    recomputes), so P=1 candidates carry recompute=False. Schedules that run the very same actions
    at a shape (at P=1, 1F1B and Varuna's: F B per micro-batch) are one candidate, under the first
    of `schedules` that gives it.

    `micro_batch_sizes` and `pipelines` restrict the search to those values (what a user fixed).
    `cluster` spreads the GPUs over hosts (None: one host, the profile's network throughout), in
    each of `placements` (default: both, "block" and "cyclic", `Cluster.placement`; each candidate
    says its own);
    `fast=False` simulates every configuration event by event (see the module docstring).

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
    spans_hosts = cluster is not None and cluster.hosts(gpus) > 1
    placements_tried: list[Placement | None] = list(placements or PLACEMENTS) if spans_hosts else [None]
    ranked: list[Candidate] = []
    rejected: list[Rejected] = []
    n = table.num_segments
    for pipeline in depths:
        data = gpus // pipeline
        if pipeline > n:
            reason = f"P={pipeline} > {n} segments (add CutPoints to cut the model finer)"
            rejected.append(Rejected(pipeline=pipeline, data=data, kind="stages", reason=reason))
            continue
        # one pipeline stage: every rank is in the one all-reduce group, so placement changes nothing
        tried = placements_tried if pipeline > 1 else placements_tried[:1]
        for mbs, placement in ((m, pl) for m in sizes for pl in tried):
            if global_batch_size % (data * mbs):
                if placement != tried[0]:
                    continue
                reason = f"global batch {global_batch_size} not divisible by D x mbs = {data} x {mbs}"
                rejected.append(
                    Rejected(pipeline=pipeline, data=data, micro_batch_size=mbs, kind="batch", reason=reason)
                )
                continue
            placed = replace(cluster, placement=placement) if cluster is not None and placement else cluster
            shape = _Shape(table, pipeline, data, mbs, placed)
            microbatches = global_batch_size // (data * mbs)
            seen: set[tuple[Any, ...]] = set()
            misfits = {
                s: chunked_misfit(table, s, pipeline, microbatches)
                if schedule_spec(s).chunks_per_rank > 1
                else None
                for s in schedules
            }
            for schedule, misfit in misfits.items():
                if misfit is not None and placement == tried[0]:
                    rejected.append(
                        Rejected(
                            pipeline=pipeline,
                            data=data,
                            micro_batch_size=mbs,
                            schedule=schedule,
                            kind="stages",
                            reason=misfit,
                        )
                    )
            for schedule, recompute in _pairs(schedules, recompute_options, pipeline):
                if misfits[schedule] is not None:
                    continue
                same = runs_as(schedule, pipeline, microbatches, recompute)
                if same in seen:
                    continue
                seen.add(same)
                found = _try(shape, schedule, recompute, global_batch_size, memory_bytes, fast)
                if isinstance(found, Candidate):
                    found.placement = placement
                    ranked.append(found)
                elif placement == tried[0]:  # what does not fit does not fit in any placement
                    rejected.append(found)
    ranked.sort(key=lambda c: (c.predicted_step_s, c.max_memory_bytes, c.pipeline, -c.micro_batch_size))
    if not ranked:
        raise PlanError(_nothing_fits(rejected, gpus, memory_bytes, global_batch_size, table, cluster))
    return PlanResult(
        ranked=ranked,
        rejected=rejected,
        gpus=gpus,
        memory_bytes=memory_bytes,
        global_batch_size=global_batch_size,
    )


def _nothing_fits(
    rejected: list[Rejected],
    gpus: int,
    memory_bytes: int,
    global_batch_size: int,
    table: CostTable,
    cluster: Cluster | None,
) -> str:
    memory = [r for r in rejected if r.kind == "memory"]
    if memory:
        while True:  # the smallest exact requirement: simulate the bounds that could be smaller
            r = min(memory, key=lambda r: r.memory_bytes or 0)
            if not r.memory_at_least or r.micro_batch_size is None or r.schedule is None:
                break
            shape = _Shape(table, r.pipeline, r.data, r.micro_batch_size, cluster)
            exact = _try(shape, r.schedule, bool(r.recompute), global_batch_size, memory_bytes, fast=False)
            assert isinstance(exact, Rejected)  # its lower bound was over the limit already
            memory[memory.index(r)] = rejected[rejected.index(r)] = exact
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
        table,
        pipeline,
        data,
        micro_batch_size,
        schedule,
        recompute and pipeline > 1,
        global_batch_size,
        boundaries,
        split_backward,
    )


def _pairs(
    schedules: Sequence[ScheduleName], recompute_options: Sequence[bool], pipeline: int
) -> list[tuple[ScheduleName, bool]]:
    """Each schedule with each recompute setting (moot at P = 1), the schedules' own settings
    first: where two run the same actions (eager-1f1b recomputing is Varuna's schedule), the
    candidate takes the name of the one that recomputes, or not, by itself; else the first given."""
    pairs = [
        (s, r) for s in schedules for r in dict.fromkeys(bool(r) and pipeline > 1 for r in recompute_options)
    ]
    return sorted(pairs, key=lambda sr: sr[1] != (schedule_spec(sr[0]).recompute and pipeline > 1))


@lru_cache(maxsize=256)
def runs_as(schedule: ScheduleName, pipeline: int, microbatches: int, recompute: bool) -> tuple[Any, ...]:
    """What the runtime does for `schedule` at a shape: its lowered action lists, and whether it
    pulls forwards ahead (Varuna's, with a stage to wait for)."""
    lists = lowered(schedule, pipeline, microbatches, recompute=recompute)
    return (
        tuple(tuple(lists[s]) for s in sorted(lists)),
        schedule_spec(schedule).pull_ahead and pipeline > 1,
    )


class _Shape:
    """Everything about one P x D x micro-batch size that does not depend on the schedule: stage
    boundaries, per-stage costs, transfers, all-reduces and updates."""

    def __init__(
        self,
        table: CostTable,
        pipeline: int,
        data: int,
        mbs: int,
        cluster: Cluster | None = None,
        boundaries: tuple[int, ...] | None = None,
    ) -> None:
        segs = table.segments
        self.table, self.pipeline, self.data, self.mbs = table, pipeline, data, mbs
        self.cluster = cluster
        self.fast = True
        if boundaries is None:
            boundaries = balance([s.forward_s[mbs] + s.backward_s[mbs] for s in segs], pipeline)
        self.boundaries = boundaries
        self.stages = stages = _stage_ranges(boundaries, len(segs))
        extra = table.action_overhead_s if pipeline > 1 else 0.0  # one stage: exactly the profiled pass
        self.costs = [
            StageCost(
                forward_s=sum(segs[j].forward_s[mbs] for j in r) + extra,
                backward_s=sum(segs[j].backward_s[mbs] for j in r) + extra,
                recompute_s=sum(segs[j].recompute_at(mbs) for j in r) + extra,
                nograd_forward_s=sum(segs[j].nograd_forward_at(mbs) for j in r) + extra,
            )
            for r in stages
        ]
        net = table.network
        links = Links(net, cluster, pipeline, data)
        self.comm = [links.p2p(s, segs[r[-1]].activation_bytes[mbs]) for s, r in enumerate(stages[:-1])]
        self.link_busy = [
            links.p2p_busy(s, segs[r[-1]].activation_bytes[mbs]) for s, r in enumerate(stages[:-1])
        ]
        self.duplex = [links.duplex(s) for s in range(len(stages) - 1)]
        self.reduce = [
            links.stage_allreduce(s, sum(segs[j].grad_bytes for j in r)) for s, r in enumerate(stages)
        ]
        self.update = [sum(segs[j].update_s for j in r) for r in stages]
        if pipeline > 1 and table.tied_bytes:
            tied = links.tied_allreduce(table.tied_bytes)
            self.reduce[0] += tied
            self.reduce[-1] += tied
            # the last stage updates its own copy of the tied weights, at segment 0's cost per byte
            self.update[-1] += segs[0].update_s * table.tied_bytes / max(segs[0].param_bytes, 1)
        self.final = links.step_allreduce(STEP_ALLREDUCE_BYTES)
        self.sharing = (
            Sharing(  # ranks share the cores of their own host only: its replicas, at most D
                replicas=data if cluster is None else cluster.replicas_sharing_cores(pipeline, data),
                slowdown=table.compute_slowdown,
                delivery=net.delivery_s,
                message_cpu_s=[net.message_cpu_time(segs[r[-1]].activation_bytes[mbs]) for r in stages[:-1]],
            )
            if table.compute_slowdown or net.delivery_s
            else None
        )

    def memory(self, recompute: bool, inflight: list[int], split_backward: bool) -> list[int]:
        """Bytes per stage with `inflight` micro-batches held at the peak."""
        return stage_memory(
            self.table.segments,
            self.table.tied_bytes,
            self.stages,
            self.mbs,
            recompute,
            inflight,
            split_backward and self.pipeline > 1,
        )

    def evaluate(
        self, schedule: ScheduleName, recompute: bool, global_batch_size: int, split_backward: bool = True
    ) -> Candidate:
        """Simulate `schedule` at this shape (twice where a crossing's two directions slow each
        other, `Links.duplex`: see the module docstring)."""
        microbatches = global_batch_size // (self.data * self.mbs)
        lists = lowered(schedule, self.pipeline, microbatches, recompute=recompute, split=split_backward)
        timeline = self._simulate(schedule, lists, microbatches, self.comm, self.link_busy)
        if any(f != 1.0 for f in self.duplex) and timeline.step_s > 0:
            stretch = [
                1.0 + (f - 1.0) * min(1.0, microbatches * busy / timeline.step_s)
                for f, busy in zip(self.duplex, self.link_busy)
            ]
            timeline = self._simulate(
                schedule,
                lists,
                microbatches,
                [c * x for c, x in zip(self.comm, stretch)],
                [b * x for b, x in zip(self.link_busy, stretch)],
            )
        return Candidate(
            pipeline=self.pipeline,
            data=self.data,
            micro_batch_size=self.mbs,
            num_microbatches=microbatches,
            schedule=schedule,
            recompute=recompute,
            boundaries=self.boundaries,
            predicted_step_s=timeline.step_s,
            samples_per_s=global_batch_size / timeline.step_s if timeline.step_s > 0 else float("inf"),
            bubble_fraction=timeline.bubble_fraction,
            memory_per_stage_bytes=self.memory(recompute, timeline.peak_inflight, split_backward),
            timeline=timeline,
        )

    def _simulate(
        self,
        schedule: ScheduleName,
        lists: Schedule,
        microbatches: int,
        comm: list[float],
        link_busy: list[float],
    ) -> Timeline:
        """One step of `lists` at this shape with these transfer and link-busy seconds per boundary."""
        return simulate_lowered(
            lists,
            self.costs,
            comm=comm,
            link_busy=link_busy,
            allreduce_s=self.reduce,
            final_allreduce_s=self.final,
            update_s=self.update,
            sharing=self.sharing,
            message_s=self.table.network.message_s,
            sees_arrivals=self.table.network.reports_arrival,
            opportunistic=schedule_spec(schedule).pull_ahead,
            name=schedule,
            num_microbatches=microbatches,
            in_order=self.fast,
        )


def _try(
    shape: _Shape, schedule: ScheduleName, recompute: bool, global_batch_size: int, limit: int, fast: bool
) -> Candidate | Rejected:
    """The candidate, or why it does not fit. With `fast`, memory over `limit` in list order is
    rejected before simulating (exactly the simulated memory without pull-ahead, a lower bound with
    it: `varuna.planner.fast`)."""
    at_least, shape.fast = False, fast
    if schedule_spec(schedule).chunks_per_rank > 1:  # P x V virtual stages: simulated event by event
        cand = chunked_candidate(
            shape.table,
            shape.pipeline,
            shape.data,
            shape.mbs,
            schedule,
            recompute,
            global_batch_size,
            cluster=shape.cluster,
        )
        if cand.max_memory_bytes <= limit:
            return cand
        need_per_stage = cand.memory_per_stage_bytes
    else:
        if fast:
            lists = lowered(
                schedule, shape.pipeline, global_batch_size // (shape.data * shape.mbs), recompute=recompute
            )
            need_per_stage = shape.memory(recompute, inflight_in_order(lists), True)
            at_least = schedule_spec(schedule).pull_ahead and shape.pipeline > 1
        if not fast or max(need_per_stage) <= limit:
            cand = shape.evaluate(schedule, recompute, global_batch_size)
            if cand.max_memory_bytes <= limit:
                return cand
            need_per_stage, at_least = cand.memory_per_stage_bytes, False
    need = max(need_per_stage)
    worst = need_per_stage.index(need)
    bound = "at least " if at_least else ""
    return Rejected(
        pipeline=shape.pipeline,
        data=shape.data,
        micro_batch_size=shape.mbs,
        schedule=schedule,
        recompute=recompute,
        kind="memory",
        reason=f"out of memory: stage {worst} needs {bound}{format_bytes(need)} > {format_bytes(limit)}",
        memory_bytes=need,
        memory_at_least=at_least,
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
    if schedule_spec(schedule).chunks_per_rank > 1:  # P x V virtual stages (varuna.planner.chunked)
        return chunked_candidate(
            table, pipeline, data, mbs, schedule, recompute, global_batch_size, boundaries, split_backward
        )
    shape = _Shape(table, pipeline, data, mbs, boundaries=boundaries)
    return shape.evaluate(schedule, recompute, global_batch_size, split_backward)
