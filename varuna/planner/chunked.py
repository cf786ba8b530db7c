"""Pricing a schedule whose ranks hold several chunks (interleaved-1f1b, zb-v): the profile cut into
P x V virtual stages, simulated by rank, with memory and reductions summed over a rank's chunks."""

from __future__ import annotations

from varuna.cut.partition import balance_ranks
from varuna.planner.cluster import Cluster, Links
from varuna.planner.costs import STEP_ALLREDUCE_BYTES, CostTable
from varuna.planner.result import Candidate
from varuna.planner.sharing import Sharing
from varuna.planner.simulator import StageCost, simulate
from varuna.schedule import ScheduleName, schedule_spec

__all__ = ["chunked_misfit", "chunked_candidate"]


def chunked_misfit(table: CostTable, schedule: ScheduleName, pipeline: int, microbatches: int) -> str | None:
    """Why `schedule` cannot run at this shape (too few segments, M not a multiple of P), or None."""
    spec = schedule_spec(schedule)
    virtual = pipeline * spec.chunks_per_rank
    if pipeline == 1:
        return f"{schedule} on one rank: its chunks would only add hand-offs (1F1B runs the same work)"
    if virtual > table.num_segments:
        return (
            f"{schedule} at P={pipeline} cuts {virtual} chunks > {table.num_segments} segments (add CutPoints, "
            "e.g. inside blocks)"
        )
    if spec.rounds and microbatches % pipeline:
        return f"{schedule} needs M={microbatches} micro-batches to be a multiple of P={pipeline}"
    return None


def chunked_candidate(
    table: CostTable,
    pipeline: int,
    data: int,
    mbs: int,
    schedule: ScheduleName,
    recompute: bool,
    global_batch_size: int,
    boundaries: tuple[int, ...] | None = None,
    split_backward: bool = True,
    cluster: Cluster | None = None,
) -> Candidate:
    """The planner's candidate for a multi-chunk schedule: one step simulated from the profile (see
    the module docstring); `cluster` prices transfers and all-reduces by host (`Links`)."""
    spec = schedule_spec(schedule)
    segs = table.segments
    virtual = pipeline * spec.chunks_per_rank
    if boundaries is None:  # the engine's choice: the ranks' loads balanced
        owners = [spec.rank_of(v, pipeline) for v in range(virtual)]
        boundaries = balance_ranks([s.forward_s[mbs] + s.backward_s[mbs] for s in segs], owners)
    edges = [-1, *boundaries, len(segs) - 1]
    stages = [range(edges[v] + 1, edges[v + 1] + 1) for v in range(virtual)]
    rank = [spec.rank_of(v, pipeline) for v in range(virtual)]
    extra = table.action_overhead_s if pipeline > 1 else 0.0
    costs = [
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
    local = [rank[v] == rank[v + 1] for v in range(virtual - 1)]  # a hand-off on one rank: free
    comm = [
        0.0 if local[v] else links.p2p(rank[v], segs[stages[v][-1]].activation_bytes[mbs], to=rank[v + 1])
        for v in range(virtual - 1)
    ]
    held = [[j for v in range(virtual) if rank[v] == p for j in stages[v]] for p in range(pipeline)]
    reduce = [links.stage_allreduce(p, sum(segs[j].grad_bytes for j in js)) for p, js in enumerate(held)]
    update = [sum(segs[j].update_s for j in js) for js in held]
    first, last = rank[0], rank[-1]
    if pipeline > 1 and table.tied_bytes and first != last:  # loop placement: ranks 0 and P-1
        tied = links.tied_allreduce(table.tied_bytes)
        reduce[first] += tied
        reduce[last] += tied
        update[last] += segs[0].update_s * table.tied_bytes / max(segs[0].param_bytes, 1)
    timeline = simulate(
        schedule,
        pipeline,
        global_batch_size // (data * mbs),
        costs,
        comm=comm,
        allreduce_s=reduce,
        final_allreduce_s=links.step_allreduce(STEP_ALLREDUCE_BYTES),
        update_s=update,
        sharing=Sharing(
            replicas=data if cluster is None else cluster.replicas_sharing_cores(pipeline, data),
            slowdown=table.compute_slowdown,
            delivery=net.delivery_s,
            message_cpu_s=[
                0.0 if local[v] else net.message_cpu_time(segs[stages[v][-1]].activation_bytes[mbs])
                for v in range(virtual - 1)
            ],
        )
        if table.compute_slowdown or net.delivery_s
        else None,
        message_s=net.message_s,
        sees_arrivals=net.reports_arrival,
        recompute=recompute,
        split_backward=split_backward,
    )
    memory = []
    for p in range(pipeline):
        mine = [v for v in range(virtual) if rank[v] == p]
        static = sum(segs[j].param_bytes + segs[j].grad_bytes + segs[j].optimizer_bytes for j in held[p])
        full = max(sum(segs[j].activation_memory_bytes[mbs] for j in stages[v]) for v in mine)
        # the peak counts chunk-activations held at once (F done, B/W not yet), of the larger chunk
        split = split_backward and any(v > 0 for v in mine)
        memory.append(static + (timeline.peak_inflight[p] + split) * full)
    if first != last and table.tied_bytes:
        total = sum(s.param_bytes for s in segs)
        per_param = sum(s.param_bytes + s.grad_bytes + s.optimizer_bytes for s in segs) / max(total, 1)
        memory[last] += int(table.tied_bytes * per_param)
    step = timeline.step_s
    return Candidate(
        pipeline=pipeline,
        data=data,
        micro_batch_size=mbs,
        num_microbatches=global_batch_size // (data * mbs),
        schedule=schedule,
        recompute=recompute,
        boundaries=boundaries,
        predicted_step_s=step,
        samples_per_s=global_batch_size / step if step > 0 else float("inf"),
        bubble_fraction=timeline.bubble_fraction,
        memory_per_stage_bytes=memory,
        timeline=timeline,
    )
