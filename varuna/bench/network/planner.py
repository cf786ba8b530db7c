"""The planner's side of the network bench: at each rate point the planner chooses a shape and a
placement from what it measured, and the bench holds the choice against what it measured.

    compute profile, once per run        4 ranks on h2 (`varuna.profile.measure.run_profile`)
    network profile at each rate    ──>  CostTable of the point ──> varuna.planner.plan ──> the pick
      (`varuna.profile.network.profile_network`                         │
       on the blocks job's ranks, h2 and h3)         the point's measured Varuna results ──> pick / best

The planner runs as `varuna plan` would on the point's profile: 4 devices on hosts of 2 (the
`Cluster` of the profiled network: ranks per host, latency and bandwidth between the hosts), both
placements ("block": hosts filled in rank order, "cyclic": ranks dealt to the hosts in turn),
with what the bench fixes for every system: its micro-batch size and schedule, no recompute. The
namespace hosts are one machine, so their ranks share its cores (`Cluster.shared_cores`); the
compute profile is taken with all four ranks on one host, where the profile sees that sharing
(its `compute_slowdown`) and fits the runtime's cost per action on it.

A pick is measured when the bench ran that shape in that placement: 1 x 4 (placement moot), 2 x 2
"block" (the replicas-across-hosts job), 2 x 2 "cyclic" (the stages-across-hosts job), 4 x 1
"block". `planner_vs_best` is the pick's measured samples/s over the best measured Varuna result of
the point (1.0: the planner picked the best), `predicted_vs_measured` its predicted step over its
measured one.

The host's speed drifts over minutes and the jobs measure one after another, so every job times
the model's compute beside its steps (the worker's `compute_gauge`) and the driver plans with the
profile's compute scaled to each job's gauge:

    network-profiling job's gauge ──> ranking ──> the pick (the planner's view when it profiled)
    each job's gauge              ──> ranking ──> predicted step of the configurations that job
                                                  measured, held against their measured steps
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from varuna.bench.network.report import label

if TYPE_CHECKING:
    from varuna.planner.cluster import Placement
    from varuna.planner.costs import CostTable
    from varuna.planner.network import NetworkCost
    from varuna.planner.result import Candidate, PlanResult

__all__ = [
    "TARGETS",
    "PLACEMENTS",
    "memory_per_device",
    "planned_cuts",
    "plan_point",
    "judge_point",
    "summarize",
]

TARGETS = {"pick_within": 0.05, "prediction_within": 0.10}
"""The issue's acceptance: the pick within 5% of the measured best Varuna shape's samples/s, its
predicted step within 10% of its measured step (reported, never asserted)."""
PLACEMENTS: tuple[Placement, ...] = ("block", "cyclic")
"""The placements the planner tries (`varuna.planner.cluster.Cluster.placement`)."""


def memory_per_device(ranks: int) -> int:
    """Bytes of this machine's memory per rank: the planner's memory limit (it never binds for the
    bench's models)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks


def _options(*, gpus: int, global_batch_size: int, micro_batch_size: int, schedule: str) -> dict[str, Any]:
    """`plan`'s keyword arguments that every point shares: what the bench fixes."""
    return {
        "gpus": gpus,
        "memory_bytes": memory_per_device(gpus),
        "global_batch_size": global_batch_size,
        "schedules": [schedule],
        "recompute_options": (False,),
        "micro_batch_sizes": [micro_batch_size],
    }


def planned_cuts(
    table: CostTable, *, gpus: int, global_batch_size: int, micro_batch_size: int, schedule: str
) -> dict[int, list[int]]:
    """P -> the stage boundaries the planner gives a P-stage pipeline (P > 1 dividing `gpus`): what
    Varuna's engines of the bench run with `NetworkBench.partition="planner"`, so that each measured
    shape is the configuration the planner prices. The planner balances the profiled compute; the
    network does not move the cut, so one plan without hosts gives it."""
    from varuna.planner.search import plan

    opts = _options(
        gpus=gpus, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, schedule=schedule
    )
    cuts = {}
    for P in (p for p in range(2, gpus + 1) if gpus % p == 0):
        cuts[P] = list(plan(table, pipelines=[P], **opts).ranked[0].boundaries)
    return cuts


def plan_point(
    table: CostTable,
    network: NetworkCost,
    *,
    gpus: int,
    global_batch_size: int,
    micro_batch_size: int,
    schedule: str,
) -> PlanResult:
    """The planner's ranking at one point: the compute profile with the point's network, on the
    cluster that network describes (its hosts sharing this machine's cores), both placements."""
    from dataclasses import replace

    from varuna.planner.cluster import Cluster
    from varuna.planner.search import plan

    cluster = Cluster.from_network(network, shared_cores=True)
    opts = _options(
        gpus=gpus, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, schedule=schedule
    )
    return plan(replace(table, network=network), cluster=cluster, placements=PLACEMENTS, **opts)


def network_summary(network: NetworkCost) -> dict[str, Any]:
    """The point's profiled network in readable units."""
    return {
        "gpus_per_host": network.gpus_per_host,
        "inter_host_mbit": round(network.inter_host_bandwidth_Bps * 8 / 1e6, 1),
        "inter_host_latency_us": round(network.inter_host_latency_s * 1e6, 1),
        "intra_host_mbit": round(network.p2p_bandwidth_Bps * 8 / 1e6, 1),
        "intra_host_latency_us": round(network.p2p_latency_s * 1e6, 1),
        "inter_host_duplex": {str(k): round(f, 3) for k, f in sorted(network.inter_host_duplex.items())},
    }


def _measured(results: list[dict[str, Any]], pipeline: int, data: int, placement: str | None) -> Any:
    """The point's Varuna result of P x D in the planner's `placement` (any for P = 1), or None."""
    for r in results:
        if r["system"] != "varuna" or r["shape"] != f"{pipeline}x{data}":
            continue
        if pipeline == 1 or r["planner_placement"] == placement:
            return r
    return None


def _priced_step_s(
    candidate: Candidate, measured: dict[str, Any] | None, by_job: Mapping[str, PlanResult] | None
) -> float:
    """The predicted step of `candidate` to hold against its `measured` result: as the ranking of
    the job that measured it prices the same shape and placement (`by_job[measured["job"]]`), or as
    `candidate` itself says where no such ranking is given or the bench did not run it."""
    if measured is None or by_job is None:
        return candidate.predicted_step_s
    job = measured["job"]
    for c in by_job[job].ranked:
        if (c.pipeline, c.data, c.placement) == (candidate.pipeline, candidate.data, candidate.placement):
            return c.predicted_step_s
    raise ValueError(
        f"job {job!r}'s ranking has no {candidate.pipeline}x{candidate.data} {candidate.placement} "
        f"configuration, which the pick's ranking has: plan every job's ranking with the same options"
    )


def judge_point(
    result: PlanResult,
    results: list[dict[str, Any]],
    network: NetworkCost,
    by_job: Mapping[str, PlanResult] | None = None,
) -> dict[str, Any]:
    """The point's `planner` section, `planner_vs_best` and `predicted_vs_measured` (None where the
    pick was not measured), from the planner's ranking and the point's measured results.

    `result` ranks and picks, and the section's `predicted_step_s` and `predicted_samples_per_s`
    are the pick's as `result` prices it (the planner's claim). `by_job` maps a job's name (each
    measured result's "job") to the ranking priced with that job's compute gauge: each measured
    configuration's `predicted_step_s` and `predicted_vs_measured` in `predictions`, and the top-level
    `predicted_vs_measured`, take the predicted step from the ranking of the job that measured it,
    so that it is held against a step measured at the same host speed. Without `by_job` every
    prediction is `result`'s."""
    predictions = []
    for c in result.ranked:
        r = _measured(results, c.pipeline, c.data, c.placement)
        predicted = _priced_step_s(c, r, by_job)
        predictions.append(
            {
                "shape": f"{c.pipeline}x{c.data}",
                "placement": c.placement,
                "measured_as": None if r is None else label(r),
                "predicted_step_s": round(predicted, 5),
                "measured_step_s": None if r is None else r["step_s"],
                "predicted_vs_measured": None if r is None else round(predicted / r["step_s"], 3),
            }
        )
    pick = result.ranked[0]
    measured = _measured(results, pick.pipeline, pick.data, pick.placement)
    pick_priced = _priced_step_s(pick, measured, by_job)
    best = max((r["samples_per_s"] for r in results if r["system"] == "varuna"), default=math.nan)
    section = {
        "shape": [pick.pipeline, pick.data],
        "placement": pick.placement,
        "measured_as": None if measured is None else label(measured),
        "predicted_step_s": round(pick.predicted_step_s, 5),
        "predicted_samples_per_s": round(pick.samples_per_s, 3),
        "micro_batch_size": pick.micro_batch_size,
        "schedule": pick.schedule,
        "recompute": pick.recompute,
        "boundaries": list(pick.boundaries),
        "network": network_summary(network),
        "predictions": predictions,
    }
    return {
        "planner": section,
        "planner_vs_best": None if measured is None else round(measured["samples_per_s"] / best, 3),
        "predicted_vs_measured": None if measured is None else round(pick_priced / measured["step_s"], 3),
    }


def summarize(points: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's `planner` summary over the points: the worst pick gap (1 - `planner_vs_best`),
    the worst prediction error of the picks (|`predicted_vs_measured` - 1|) and of every measured
    configuration, the points whose pick was not measured, and whether the targets hold; beside them
    the measurement's own resolution, the median and worst `split_half_gap` of the Varuna results at
    the judged points (an A/A check of each result: a gap or error not above it is not measured)."""
    judged = [p for p in points if p.get("planner") is not None]
    gaps = [1 - p["planner_vs_best"] for p in judged if p["planner_vs_best"] is not None]
    errors = [abs(p["predicted_vs_measured"] - 1) for p in judged if p["predicted_vs_measured"] is not None]
    every = [
        abs(x["predicted_vs_measured"] - 1)
        for p in judged
        for x in p["planner"]["predictions"]
        if x["predicted_vs_measured"] is not None
    ]
    halves = [
        r["split_half_gap"]
        for p in judged
        for r in p.get("results", ())
        if r["system"] == "varuna" and r.get("split_half_gap") is not None
    ]
    unmeasured = [p["rate_mbit"] for p in judged if p["planner_vs_best"] is None]
    worst_gap = round(max(gaps), 3) if gaps else None
    worst_error = round(max(errors), 3) if errors else None
    complete = bool(judged) and not unmeasured
    return {
        "points": len(judged),
        "targets": dict(TARGETS),
        "worst_pick_gap": worst_gap,
        "worst_prediction_error": worst_error,
        "worst_prediction_error_any_shape": round(max(every), 3) if every else None,
        "unmeasured_picks": unmeasured,
        "split_half_gap_median": round(statistics.median(halves), 3) if halves else None,
        "split_half_gap_worst": round(max(halves), 3) if halves else None,
        "pick_target_met": complete and worst_gap is not None and worst_gap <= TARGETS["pick_within"],
        "prediction_target_met": complete
        and worst_error is not None
        and worst_error <= TARGETS["prediction_within"],
    }
