"""The network benchmark's report: where the ranks ran, the crossover, the table with the planner's
picks (`varuna.bench.network.driver` runs the jobs, `varuna.bench.network.planner` judges the
picks, `varuna.bench.network.plot` draws the figure)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "system_key",
    "expected_hosts",
    "placement_of",
    "label",
    "crossover",
    "planner_lines",
    "format_table",
]

SHORT = {"replicas-across-hosts": "replicas apart", "stages-across-hosts": "stages apart"}


def system_key(system: dict[str, Any]) -> str:
    """The name of a job's system in the worker's results: ``"varuna 2x2"``, ``"ddp 1x4"``."""
    return f"{system['system']} {system['pipeline']}x{system['data']}"


def expected_hosts(slots: dict[str, int], ranks: int) -> list[str]:
    """The host of each rank as MPICH's hydra places them: the hostfile's slots in order, cycling
    through the file again until every rank has one.

    >>> expected_hosts({"h2": 2, "h3": 2}, 4), expected_hosts({"h2": 1, "h3": 1}, 4)
    (['h2', 'h2', 'h3', 'h3'], ['h2', 'h3', 'h2', 'h3'])
    """
    if not slots or sum(slots.values()) < 1:
        raise ValueError(f"a hostfile needs at least one slot (got {slots})")
    hosts: list[str] = []
    while len(hosts) < ranks:
        for host, n in slots.items():
            hosts += [host] * n
    return hosts[:ranks]


def placement_of(hosts: list[str], pipeline: int, data: int) -> str | None:
    """Which dimension of a P x D job crosses hosts, from each rank's host (rank r is stage r % P of
    replica r // P): "replicas-across-hosts" (every replica inside one host, the replicas on different
    hosts: the all-reduce crosses), "stages-across-hosts" (every replica's stages on different hosts,
    each stage's replicas inside one host: activations cross), "mixed", or None for P or D of 1.

    >>> placement_of(["h2", "h2", "h3", "h3"], 2, 2), placement_of(["h2", "h3", "h2", "h3"], 2, 2)
    ('replicas-across-hosts', 'stages-across-hosts')
    """
    if len(hosts) != pipeline * data:
        raise ValueError(f"{len(hosts)} hosts for a {pipeline}x{data} job")
    if pipeline == 1 or data == 1:
        return None
    replicas = [set(hosts[d * pipeline : (d + 1) * pipeline]) for d in range(data)]
    stages = [{hosts[d * pipeline + s] for d in range(data)} for s in range(pipeline)]
    if all(len(r) == 1 for r in replicas) and len(set().union(*replicas)) == data:
        return "replicas-across-hosts"
    if all(len(r) == pipeline for r in replicas) and all(len(s) == 1 for s in stages):
        return "stages-across-hosts"
    return "mixed"


def label(result: dict[str, Any]) -> str:
    """A result's name in the table and the figure: ``varuna 2x2 (stages apart)``."""
    where = result.get("placement")
    return f"{result['system']} {result['shape']}" + (f" ({SHORT.get(where, where)})" if where else "")


def _rate(rate: float | None) -> str:
    return "unshaped" if rate is None else f"{rate:g} Mbit/s"


def crossover(points: list[dict[str, Any]]) -> dict[str, Any]:
    """`crossover_mbit`: the highest shaped rate at which Varuna's best pipelined shape (P > 1) beats
    both Varuna 1x4 and DDP, None where it beats them at none; `crossover`: per rate that shape, its
    samples/s over the better of the two, and whether it already wins unshaped.

    >>> pts = [{"rate_mbit": r, "results": [
    ...     {"system": "varuna", "shape": "1x4", "samples_per_s": dp},
    ...     {"system": "ddp", "shape": "1x4", "samples_per_s": dp},
    ...     {"system": "varuna", "shape": "4x1", "samples_per_s": 10.0}]}
    ...     for r, dp in ((None, 20.0), (2000.0, 12.0), (1000.0, 9.0), (50.0, 4.0))]
    >>> crossover(pts)["crossover_mbit"]
    1000.0
    """
    rows = []
    for point in points:
        results = point["results"]
        data_parallel = [r for r in results if r["shape"] == "1x4" and r["system"] in ("varuna", "ddp")]
        piped = [r for r in results if r["system"] == "varuna" and not r["shape"].startswith("1x")]
        if not data_parallel or not piped:
            continue
        best = max(piped, key=lambda r: r["samples_per_s"])
        rival = max(data_parallel, key=lambda r: r["samples_per_s"])
        rows.append(
            {
                "rate_mbit": point["rate_mbit"],
                "best_pipelined": label(best),
                "best_data_parallel": label(rival),
                "pipelined_over_data_parallel": round(best["samples_per_s"] / rival["samples_per_s"], 3),
                "pipelined_wins": best["samples_per_s"] > rival["samples_per_s"],
            }
        )
    wins = [r["rate_mbit"] for r in rows if r["pipelined_wins"] and r["rate_mbit"] is not None]
    unshaped = next((r for r in rows if r["rate_mbit"] is None), None)
    return {
        "crossover_mbit": max(wins) if wins else None,
        "crossover": {
            "by_rate": rows,
            "pipelined_wins_unshaped": None if unshaped is None else unshaped["pipelined_wins"],
        },
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def planner_lines(report: dict[str, Any]) -> list[str]:
    """Per rate the planner's pick beside the measured best Varuna result, then the worst gap and
    error against the targets; nothing when no point has a pick."""
    summary = report.get("planner")
    if not summary or not summary.get("points"):
        return []
    opts = summary["options"]
    lines = [
        f"planner, on the network profiled at each rate (micro-batch {opts['micro_batch_size']}, "
        f"{opts['schedule']}, {opts['gpus']} devices on {opts['hosts']} hosts sharing the cores):"
    ]
    for point in report["points"]:
        pick = point["planner"]
        if pick is None:
            lines.append(f"{_rate(point['rate_mbit'])}: no network profile")
            continue
        P, D = pick["shape"]
        line = f"{_rate(point['rate_mbit'])}: picks {P}x{D} {pick['placement']}"
        measured = pick["predictions"][0]["measured_step_s"]
        if point["planner_vs_best"] is None or measured is None:
            lines.append(f"{line} (not measured), predicted step {pick['predicted_step_s']:.4f} s")
            continue
        # the pick as priced at the host speed of the job that measured it, as its ratio is
        predicted = pick["predictions"][0]["predicted_step_s"]
        varuna = [r for r in point["results"] if r["system"] == "varuna"]
        best = max(varuna, key=lambda r: r["samples_per_s"])
        lines.append(
            f"{line} = {pick['measured_as']}: predicted step {predicted:.4f} s, measured {measured:.4f} s "
            f"({point['predicted_vs_measured']:.2f}); best measured {label(best)}, pick / best "
            f"{point['planner_vs_best']:.2f}"
        )
    targets = summary["targets"]
    lines.append(
        f"worst pick gap {_pct(summary['worst_pick_gap'])} (target <= {_pct(targets['pick_within'])}: "
        f"{_met(summary['pick_target_met'])}); worst prediction error {_pct(summary['worst_prediction_error'])} "
        f"(target <= {_pct(targets['prediction_within'])}: {_met(summary['prediction_target_met'])}); of any "
        f"measured shape {_pct(summary['worst_prediction_error_any_shape'])}"
    )
    if summary.get("split_half_gap_worst") is not None:
        lines.append(
            f"the measurement's own resolution (medians of alternate timed steps of one Varuna result): "
            f"median gap {_pct(summary['split_half_gap_median'])}, worst {_pct(summary['split_half_gap_worst'])}"
        )
    if summary["unmeasured_picks"]:
        lines.append(f"picks not measured at {', '.join(_rate(r) for r in summary['unmeasured_picks'])}")
    return lines


def format_table(report: dict[str, Any]) -> str:
    """Samples/s per rate (rows) and system, shape and placement (columns), then the crossover and
    the planner's picks."""
    m = report["model"]
    cfg = m["config"]
    names: list[str] = []
    for point in report["points"]:
        for r in point["results"]:
            if label(r) not in names:
                names.append(label(r))
    width = max(len(n) for n in names) + 2
    lines = [
        f"GPT {cfg['n_layer']} blocks, d_model {cfg['d_model']}, seq {cfg['seq_len']}, vocab {cfg['vocab_size']}: "
        f"{m['params'] / 1e6:.2f}M params ({m['gradient_mib']} MiB of gradients); global batch "
        f"{report['global_batch']}, micro-batch {report['micro_batch']}; 4 ranks on h2, h3 "
        f"({report['hosts']['host_cores']} cores, 1 thread/rank)",
        "",
        "samples/s",
        f"{'system':<{width}}" + "".join(f"{_rate(p['rate_mbit']):>16}" for p in report["points"]),
    ]
    seen = [max(p.get("link_mbit_seen", {}).values(), default=float("nan")) for p in report["points"]]
    lines.append(f"{'(link seen by gloo, Mbit/s)':<{width}}" + "".join(f"{x:>16.0f}" for x in seen))
    for name in names:
        row = [next((r for r in p["results"] if label(r) == name), None) for p in report["points"]]
        cells = "".join(f"{'-' if r is None else format(r['samples_per_s'], '.2f'):>16}" for r in row)
        lines.append(f"{name:<{width}}{cells}")
    lines.append("")
    for r in report["crossover"]["by_rate"]:
        lines.append(
            f"{_rate(r['rate_mbit'])}: best pipelined {r['best_pipelined']} / best data parallel "
            f"{r['best_data_parallel']} = {r['pipelined_over_data_parallel']:.2f}"
        )
    x = report["crossover_mbit"]
    lines.append(
        "crossover: "
        + ("none (data parallelism wins at every shaped rate)" if x is None else f"{x:g} Mbit/s")
        + ("; pipelining already wins unshaped" if report["crossover"]["pipelined_wins_unshaped"] else "")
    )
    planned = planner_lines(report)
    if planned:
        lines += ["", *planned, ""]
    for name, p in report["placements_verified"].items():
        lines.append(
            f"placement {name}: ranks on {p['rank_hosts']} ({'verified' if p['verified'] else 'NOT as expected'})"
        )
    lines.append(f"plot {report['plot']}; wall time {report['wall_s']:.0f} s")
    return "\n".join(lines)
