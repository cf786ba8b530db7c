"""The pipeline benchmark's report: ratios between the systems, the issue's targets, each
schedule's compute ceiling, and the text table (`varuna.bench.pipeline.driver` runs the jobs)."""

from __future__ import annotations

import functools
import random
import statistics
from typing import Any

__all__ = ["compute_ceilings", "compute_ratios", "format_table", "paired_ratios", "targets"]


def _ratios(results: list[dict[str, Any]], rate: str) -> dict[str, Any]:
    single = next(r for r in results if r["system"] == "single")[rate]
    by = {(r["system"], r["schedule"], r["pipeline"]): r for r in results}
    vs_torch: dict[str, dict[str, float]] = {}
    of_ideal: dict[str, dict[str, dict[str, float]]] = {}
    ideal: dict[str, float] = {}
    for r in results:
        if r["system"] == "single":
            continue
        P, M, key = r["pipeline"], r["microbatches"], f"P{r['pipeline']}"
        ideal[key] = M / (M + P - 1) * P * single
        base = r.get("single_" + rate, single)  # measured in the same rounds (paired), else the single job
        of_ideal.setdefault(r["system"], {}).setdefault(key, {})[r["schedule"]] = r[rate] / (
            M / (M + P - 1) * P * base
        )
        other = by.get(("torch.pipelining", r["schedule"], P))
        if r["system"] == "varuna" and other is not None:
            vs_torch.setdefault(key, {})[r["schedule"]] = r[rate] / other[rate]
    return {
        "varuna_over_torch_pipelining": vs_torch,
        "of_bubble_ideal": of_ideal,
        "bubble_ideal_samples_per_s": ideal,
    }


def _summary(values: list[float], *, rng: random.Random, resamples: int = 2000) -> dict[str, Any]:
    """The median of per-round ratios, with a 90% bootstrap interval (rounds resampled)."""
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return {
        "median": round(statistics.median(values), 4),
        "ci90": [round(medians[int(0.05 * resamples)], 4), round(medians[int(0.95 * resamples) - 1], 4)],
        "pairs": len(values),
    }


def paired_ratios(results: list[dict[str, Any]], resamples: int = 2000) -> dict[str, Any]:
    """From the paired job: per P and schedule, the median over rounds of torch.pipelining's step time
    over Varuna's (> 1: Varuna faster), and under "of_bubble_ideal" each pipeline's share of its
    bubble-limited ideal M / (M + P - 1) * P * single with the single step of the same round; each
    with a 90% bootstrap interval (rounds resampled, fixed seed)."""
    rng = random.Random(0)
    summary = functools.partial(_summary, rng=rng, resamples=resamples)
    vs_torch: dict[str, dict[str, Any]] = {}
    of_ideal: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        key = f"P{r['pipeline']}"
        if r["system"] == "varuna" and r.get("pair_ratios"):
            vs_torch.setdefault(key, {})[r["schedule"]] = summary(r["pair_ratios"])
        if r.get("of_ideal_per_round"):
            of_ideal.setdefault(r["system"], {}).setdefault(key, {})[r["schedule"]] = summary(
                r["of_ideal_per_round"]
            )
    return {"varuna_over_torch_pipelining": vs_torch, "of_bubble_ideal": of_ideal}


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets at the smallest P (the paired job): Varuna's fastest schedule over
    torch.pipelining's 1F1B and over its fastest schedule, and the smallest paired ratio over the
    schedules both run (each should be >= 1). Where torch's 1F1B ran in every schedule's rounds
    (`ref_ratios`), the first two compare step by step with it (its step over each system's, the
    median of the rounds; the best schedules are those fastest by it), and the comparison of median
    samples/s of rounds run minutes apart is kept under "unpaired"."""
    P = min(r["pipeline"] for r in results if r["system"] != "single")
    rate = {
        system: {
            r["schedule"]: r["samples_per_s"] for r in results if r["system"] == system and r["pipeline"] == P
        }
        for system in ("varuna", "torch.pipelining")
    }
    mine, theirs = rate["varuna"], rate["torch.pipelining"]
    if not mine or not theirs:
        return {}
    best, best_torch = max(mine, key=mine.__getitem__), max(theirs, key=theirs.__getitem__)
    paired = paired_ratios(results)["varuna_over_torch_pipelining"].get(f"P{P}", {})
    worst = min(paired, key=lambda s: paired[s]["median"]) if paired else None
    out: dict[str, Any] = {
        "pipeline": P,
        "varuna_best": best,
        "torch_best": best_torch,
        "varuna_best_over_torch_best": round(mine[best] / theirs[best_torch], 4),
        "worst_same_schedule": None if worst is None else {"schedule": worst, **paired[worst]},
    }
    if "1f1b" in theirs:
        out["varuna_best_over_torch_1f1b"] = round(mine[best] / theirs["1f1b"], 4)
    reference = _over_reference(results, P)
    if reference:  # measured step by step beside torch's 1F1B: these are the targets, the above unpaired
        out["unpaired"] = {k: out[k] for k in ("varuna_best", "torch_best", "varuna_best_over_torch_best")}
        out["unpaired"]["varuna_best_over_torch_1f1b"] = out.get("varuna_best_over_torch_1f1b")
        v, t = reference["varuna"], reference["torch.pipelining"]
        best = max(v, key=lambda s: v[s]["median"])
        best_torch = max(t, key=lambda s: t[s]["median"])
        out |= {
            "varuna_best": best,
            "torch_best": best_torch,
            "varuna_best_over_torch_1f1b": v[best]["median"],
            "varuna_best_over_torch_1f1b_ci90": v[best]["ci90"],
            "varuna_best_over_torch_best": round(v[best]["median"] / t[best_torch]["median"], 4),
            "over_torch_1f1b": reference,
        }
    return out


def _over_reference(results: list[dict[str, Any]], P: int) -> dict[str, dict[str, Any]]:
    """Per system and schedule at P: its step over torch.pipelining's 1F1B step in the same rounds
    (`ref_ratios`, > 1: faster than torch's 1F1B), median and 90% interval; {} without them."""
    rng = random.Random(0)
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["pipeline"] == P and r.get("ref_ratios"):
            out.setdefault(r["system"], {})[r["schedule"]] = _summary(r["ref_ratios"], rng=rng)
    return out if {"varuna", "torch.pipelining"} <= set(out) else {}


def compute_ceilings(results: list[dict[str, Any]]) -> dict[str, Any]:
    """How fast each Varuna schedule could be at the smallest P, from the work its ranks did.

    A rank's step lasts at least the CPU seconds its main thread spent in it (where every forward,
    backward and optimizer step runs; a thread's CPU time never exceeds the wall time). So, per
    schedule, torch.pipelining's 1F1B step over the busiest rank's main-thread CPU seconds bounds
    the ratio any order of that work could reach at these stage boundaries, idle and waiting all
    removed (`over_torch_1f1b_at_these_cuts`), and over the ranks' mean the ratio even perfectly
    balanced stages could reach (`over_torch_1f1b_balanced`). No order avoids the fill either: rank
    s cannot start before ranks 0 .. s-1 ran their first forward, so the ranks together idle at
    least the sum over s of those forwards (each rank's median forward of its first virtual stage,
    `first_forward_s_per_stage`); shared by the P ranks with the work, that gives
    `over_torch_1f1b_balanced_with_fill`, the most any order and any balance of this work could
    reach. A schedule whose work is larger (a split backward's second pass, two chunks' extra
    messages) has a lower ceiling, whatever its bubble. Torch's 1F1B step is the one of the
    schedule's own rounds where it ran there (`ref_ratios`: the median ratio times the schedule's
    median step), so the host's drift between schedules stays out. Measured bounds, not targets:
    {} without a torch 1F1B.
    """
    P = min(r["pipeline"] for r in results if r["system"] != "single")
    at_p = [r for r in results if r["pipeline"] == P]
    base = next((r for r in at_p if r["system"] == "torch.pipelining" and r["schedule"] == "1f1b"), None)
    if base is None:
        return {}
    out: dict[str, Any] = {
        "pipeline": P,
        "torch_1f1b_step_s": round(base["median_step_s"], 4),
        "schedules": {},
    }
    for r in at_p:
        if r["system"] != "varuna":
            continue
        # torch's 1F1B step as it ran in this schedule's rounds (the reference), else in its own
        torch_step = (
            statistics.median(r["ref_ratios"]) * r["median_step_s"]
            if r.get("ref_ratios")
            else base["median_step_s"]
        )
        cpu = r.get("thread_cpu_s_per_step_per_stage") or r["cpu_s_per_step_per_stage"]
        busiest, mean = max(cpu), sum(cpu) / len(cpu)
        out["schedules"][r["schedule"]] = {
            "busiest_rank_thread_cpu_s": round(busiest, 4),
            "mean_rank_thread_cpu_s": round(mean, 4),
            "measured_over_torch_1f1b": round(torch_step / r["median_step_s"], 4),
            "over_torch_1f1b_at_these_cuts": round(torch_step / busiest, 4),
            "over_torch_1f1b_balanced": round(torch_step / mean, 4),
        }
        forwards = r.get("first_forward_s_per_stage")
        if forwards:
            fill = sum(sum(forwards[:s]) for s in range(len(forwards)))
            out["schedules"][r["schedule"]]["over_torch_1f1b_balanced_with_fill"] = round(
                torch_step / ((sum(cpu) + fill) / len(cpu)), 4
            )
    return out


def compute_ratios(results: list[dict[str, Any]], host_cores: int) -> dict[str, Any]:
    """varuna / torch.pipelining per (P, schedule), and every pipeline's share of its bubble-limited ideal.

    From the median steps (`samples_per_s`), and again under `from_best_step` from the fastest
    steps (`best_samples_per_s`), which a host busy with other work distorts less.
    """
    pipelines = sorted({r["pipeline"] for r in results if r["system"] != "single"})
    return {
        **_ratios(results, "samples_per_s"),
        "paired": paired_ratios(results),
        "targets": targets(results),
        "ceilings": compute_ceilings(results),
        "from_best_step": _ratios(results, "best_samples_per_s"),
        "oversubscribed": {f"P{P}": P > host_cores for P in pipelines},
    }


def format_table(report: dict[str, Any]) -> str:
    """The results and ratios as aligned text."""
    m = report["model"]
    lines = [
        f"GPT {m['config']['n_layer']} blocks, d_model {m['config']['d_model']}, seq {m['config']['seq_len']}, "
        f"{m['params'] / 1e6:.2f}M params; batch {m['global_batch_size']} = {m['microbatches']} x "
        f"{m['micro_batch_size']}; {m['threads_per_rank']} thread/rank on {m['host_cores']} cores "
        f"(load {m['load_before'][0]:.2f} before, {m['load_after'][0]:.2f} after)",
        "",
        f"{'system':<17} {'schedule':<16} {'P':>2} {'M':>2} {'samples/s':>10} {'best':>7} {'step s':>8} "
        f"{'of ideal':>9} {'cpu s/step per stage':>28} {'step peak MB per stage':>24}",
    ]
    ideal = report["ratios"]["of_bubble_ideal"]
    for r in report["results"]:
        share = ideal.get(r["system"], {}).get(f"P{r['pipeline']}", {}).get(r["schedule"])
        lines.append(
            f"{r['system']:<17} {r['schedule'] or '-':<16} {r['pipeline']:>2} {r['microbatches']:>2} "
            f"{r['samples_per_s']:>10.2f} {r['best_samples_per_s']:>7.2f} {r['median_step_s']:>8.3f} "
            f"{'' if share is None else f'{share:.2f}':>9} "
            f"{' '.join(f'{c:.3f}' for c in r['cpu_s_per_step_per_stage']):>28} "
            f"{' '.join('-' if b is None else f'{b / 2**20:.1f}' for b in r.get('step_peak_bytes_per_stage') or []):>24}"
        )
    lines.append("")
    best = report["ratios"]["from_best_step"]["varuna_over_torch_pipelining"]
    for key, per in report["ratios"]["varuna_over_torch_pipelining"].items():
        flag = " (oversubscribed)" if report["ratios"]["oversubscribed"].get(key) else ""
        pairs = ", ".join(f"{s} {v:.2f} (best steps {best[key][s]:.2f})" for s, v in per.items())
        lines.append(f"varuna / torch.pipelining at {key}{flag}: {pairs}")
    paired = report["ratios"]["paired"]
    for system, by_p in paired["of_bubble_ideal"].items():
        for p, shares in by_p.items():
            text = ", ".join(
                f"{s} {v['median']:.3f} ({v['ci90'][0]:.3f}-{v['ci90'][1]:.3f})" for s, v in shares.items()
            )
            lines.append(
                f"paired, {system} at {p} of its ideal (single, or torch 1f1b, in the same rounds): {text}"
            )
    for key, per in paired["varuna_over_torch_pipelining"].items():
        pairs = ", ".join(
            f"{s} {v['median']:.3f} (90% interval {v['ci90'][0]:.3f}-{v['ci90'][1]:.3f}, {v['pairs']} pairs)"
            for s, v in per.items()
        )
        lines.append(f"paired, torch step / varuna step at {key}: {pairs}")
    goal = report["ratios"].get("targets") or {}
    if goal.get("over_torch_1f1b"):
        for system, per in goal["over_torch_1f1b"].items():
            text = ", ".join(
                f"{s} {v['median']:.3f} ({v['ci90'][0]:.3f}-{v['ci90'][1]:.3f})" for s, v in per.items()
            )
            lines.append(
                f"paired, torch 1f1b step / {system} step at P{goal['pipeline']} (same rounds): {text}"
            )
    if goal:
        worst = goal["worst_same_schedule"]
        how = "paired with torch 1f1b" if goal.get("over_torch_1f1b") else "median samples/s"
        lines.append(
            f"targets at P{goal['pipeline']} ({how}): varuna's best ({goal['varuna_best']}) / torch 1f1b "
            f"{goal.get('varuna_best_over_torch_1f1b', float('nan')):.3f} (>= 1.10), / torch's best "
            f"({goal['torch_best']}) {goal['varuna_best_over_torch_best']:.3f} (>= 1.0)"
            + (
                ""
                if worst is None
                else f"; worst same-schedule pair {worst['schedule']} {worst['median']:.3f}"
            )
        )
    ceil = report["ratios"].get("ceilings") or {}
    if ceil:
        per = ceil["schedules"]
        lines.append(
            f"ceilings at P{ceil['pipeline']} (torch 1f1b step / a rank's main-thread CPU s per step: no order "
            "of that work beats it): measured <= at these cuts, balanced (with the fill): "
            + ", ".join(
                f"{s} {c['measured_over_torch_1f1b']:.3f} <= {c['over_torch_1f1b_at_these_cuts']:.3f}, "
                f"{c['over_torch_1f1b_balanced']:.3f}"
                + (
                    f" ({c['over_torch_1f1b_balanced_with_fill']:.3f})"
                    if "over_torch_1f1b_balanced_with_fill" in c
                    else ""
                )
                for s, c in per.items()
            )
        )
    lines.append(f"wall time {report['wall_s']:.0f} s")
    return "\n".join(lines)
