"""What limits a plan: where the best configuration's step goes and why the shapes next to it lost.

`explain(result)` reads a `PlanResult` and says, for its best configuration:

- `shares`: its step split into compute, imbalance (the busiest stage's compute over the average
  one's: the segments do not split evenly into P stages), bubble (the rest of the waiting, the
  update, the per-step all-reduce) and gradient all-reduce, averaged over the stages (adding up to 1);
- `fewer_stages` / `more_stages`: the nearest pipeline depth below and above it, either the reason
  none fits there (out of memory, batch not divisible, too many stages) or its best step time;
- `limited_by`: the words for what stops a faster plan, most important first: "memory" (the next
  shallower pipeline does not fit, or only with smaller micro-batches or recompute), "batch" (more replicas or larger micro-batches do not divide the global
  batch, or few micro-batches per replica), "bubble", "imbalance" and "all-reduce" (the overheads
  of the step above 5%, largest first).
"""

from __future__ import annotations

from typing import Any

from varuna.planner.result import Candidate, PlanResult, Rejected

__all__ = ["explain", "format_limits"]

_NOTABLE = 0.05  # an overhead share worth naming


def _shares(c: Candidate) -> dict[str, float]:
    t = c.timeline
    step, p = t.step_s or 1.0, len(t.busy_s) or 1
    compute = sum(t.busy_s) / (p * step)
    allreduce = sum(t.allreduce_s) / (p * step)
    imbalance = (max(t.busy_s, default=0.0) - sum(t.busy_s) / p) / step
    return {
        "compute": compute,
        "imbalance": imbalance,
        "bubble": max(0.0, 1.0 - compute - imbalance - allreduce),
        "allreduce": allreduce,
    }


def _neighbour(result: PlanResult, depth: int) -> dict[str, Any]:
    here = [c for c in result.ranked if c.pipeline == depth]
    if here:
        c = here[0]
        s = _shares(c)
        # memory held it back if it ran smaller micro-batches or recomputed than its larger
        # micro-batches / no recompute would have needed
        held_back = [
            r
            for r in result.rejected
            if r.pipeline == depth
            and r.kind == "memory"
            and ((r.micro_batch_size or 0) > c.micro_batch_size or (c.recompute and not r.recompute))
        ]
        why = (
            f"slower: {c.predicted_step_s:.4g} s with micro-batch {c.micro_batch_size}"
            f"{' and recompute' if c.recompute else ''} (bubble {100 * s['bubble']:.0f}%, "
            f"all-reduce {100 * s['allreduce']:.0f}%)"
        )
        memory = bool(held_back) and (c.recompute or c.micro_batch_size < result.best.micro_batch_size)
        if memory:
            r = min(held_back, key=lambda r: r.memory_bytes or 0)
            why += f"; micro-batch {r.micro_batch_size}{' with' if r.recompute else ' without'} recompute "
            why += r.reason
        return {
            "pipeline": depth,
            "data": c.data,
            "fits": True,
            "memory": memory,
            "predicted_step_s": c.predicted_step_s,
            "why": why,
        }
    out: list[Rejected] = [r for r in result.rejected if r.pipeline == depth]
    kinds = {r.kind for r in out}
    kind = "memory" if "memory" in kinds else ("stages" if "stages" in kinds else "batch")
    picked = [r for r in out if r.kind == kind]
    if kind == "memory":
        r = min(picked, key=lambda r: r.memory_bytes or 0)
    else:
        r = picked[0]
    return {
        "pipeline": depth,
        "data": out[0].data if out else None,
        "fits": False,
        "kind": kind,
        "why": r.reason,
    }


def explain(result: PlanResult) -> dict[str, Any]:
    """The limits of `result.best` (see the module docstring), JSON-ready."""
    best = result.best
    shares = _shares(best)
    depths = sorted({c.pipeline for c in result.ranked} | {r.pipeline for r in result.rejected})
    below = [p for p in depths if p < best.pipeline]
    above = [p for p in depths if p > best.pipeline]
    fewer = _neighbour(result, below[-1]) if below else None
    more = _neighbour(result, above[0]) if above else None
    limited: list[str] = []
    if fewer is not None and (fewer["memory"] if fewer["fits"] else fewer["kind"] == "memory"):
        limited.append("memory")
    bigger_mbs = any(
        r.kind == "batch"
        and r.pipeline == best.pipeline
        and (r.micro_batch_size or 0) > best.micro_batch_size
        for r in result.rejected
    )
    if (fewer is not None and not fewer["fits"] and fewer["kind"] == "batch") or bigger_mbs:
        limited.append("batch")
    elif best.pipeline > 1 and best.num_microbatches < 2 * best.pipeline:
        limited.append("batch")  # few micro-batches per replica: a bubble the batch cannot fill
    for name in sorted(("bubble", "imbalance", "allreduce"), key=lambda k: -shares[k]):
        if shares[name] > _NOTABLE:
            limited.append("all-reduce" if name == "allreduce" else name)
    if not limited:
        limited.append("compute")
    return {
        "pipeline": best.pipeline,
        "data": best.data,
        "micro_batch_size": best.micro_batch_size,
        "num_microbatches": best.num_microbatches,
        "shares": shares,
        "fewer_stages": fewer,
        "more_stages": more,
        "limited_by": limited,
    }


def format_limits(result: PlanResult) -> list[str]:
    """`explain` as the lines `varuna plan` prints under its table."""
    e = explain(result)
    s = e["shares"]
    lines = [
        f"limited by {', '.join(e['limited_by'])}: best P={e['pipeline']} x D={e['data']} x micro-batch "
        f"{e['micro_batch_size']} (M={e['num_microbatches']}), step {100 * s['compute']:.0f}% compute, "
        f"{100 * s['imbalance']:.0f}% imbalance, {100 * s['bubble']:.0f}% bubble, "
        f"{100 * s['allreduce']:.0f}% all-reduce"
    ]
    for key, label in (("fewer_stages", "fewer stages"), ("more_stages", "more stages")):
        n = e[key]
        if n is not None:
            lines.append(f"  {label} (P={n['pipeline']}, D={n['data']}): {n['why']}")
    return lines
