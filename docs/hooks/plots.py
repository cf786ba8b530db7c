"""MkDocs hook: the benchmark pages' figures, drawn at build time from the dated result files.

A benchmark page asks for a figure with a line of its own, `<!-- plot: NAME -->`, where NAME is a key
of `PLOTS`; the hook replaces it with the figure and a caption linking the result files it was drawn
from. The data are `docs/benchmarks/results/<YYYY-MM-DD>-<bench>.json`, one file per dated run (see
docs/benchmarks/index.md): each names its `bench`, `date`, the `page` that reports it and the `source`
of its numbers, and holds the fields `SCHEMAS[bench]` requires. A rerun adds a file and the next
`make docs` draws it; no image is committed.

    mkdocs.yml:   hooks: [docs/hooks/plots.py]
    a page:       <!-- plot: pipeline-ratios -->
    the site:     site/benchmarks/img/pipeline-ratios.svg, embedded where the marker was

A result file that lacks a field, or a marker that names no plot, fails the build with the file and
field to fix (tests/unit/test_docs.py checks both without building the site).
"""

from __future__ import annotations

import io
import json
import math
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
FILENAME = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2})-(?P<bench>[a-z][a-z0-9-]*)\.json$")
MARKER = re.compile(r"^<!-- plot: (?P<name>[^ ]+) -->$", re.MULTILINE)
IMG_DIR = "benchmarks/img"

# A tiny schema language for the result files: a type (or a tuple of types) is an isinstance check
# (bool is no number); {"key": schema, ...} a record with those keys (others allowed); {str: schema} a
# mapping of names to values; [schema] a non-empty list of items.
NUMBER = (int, float)
NUMBER_OR_NONE = (int, float, type(None))
SCHEMAS: dict[str, Any] = {
    "pipeline": {
        "goal_over_torch_1f1b": NUMBER,
        "runs": [
            {
                "run": str,
                "over_torch_1f1b": {"varuna": {str: NUMBER}, "torch": {str: NUMBER}},
                "pairs": {str: NUMBER},
            }
        ],
    },
    "memory": {
        "unit": str,
        "whole_model_growth": NUMBER,
        "ranks": [
            {
                "system": str,
                "P": int,
                "rank": int,
                "growth": NUMBER,
                "estimate": NUMBER_OR_NONE,
                "error_pct": NUMBER_OR_NONE,
            }
        ],
    },
    "planner": {
        "targets": {
            "mean_abs_error_pct": NUMBER,
            "max_abs_error_pct": NUMBER,
            "spearman": NUMBER,
            "best_gap": NUMBER,
        },
        "runs": [
            {
                "model": str,
                "mean_abs_error_pct": NUMBER,
                "max_abs_error_pct": NUMBER,
                "spearman": NUMBER,
                "best_gap_pct": NUMBER,
            }
        ],
    },
    "network": {
        "unit": str,
        "crossover_mbit": NUMBER_OR_NONE,
        "points": [{"rate_mbit": NUMBER_OR_NONE, "samples_per_s": {str: NUMBER}}],
    },
    "spot": {
        "unit": str,
        "runs": [{"run": str, "ideal": NUMBER, "goodput": {str: NUMBER}}],
    },
    "checkpoint": {
        "unit": str,
        "runs": [{"run": str, "step_ms": {str: NUMBER}}],
    },
    "planner-scale": {
        "rows": [
            {
                "gpus": int,
                "shape": str,
                "samples_per_s": NUMBER,
                "bubble_pct": NUMBER,
                "imbalance_pct": NUMBER,
                "allreduce_pct": NUMBER,
            }
        ]
    },
}


class ResultsError(ValueError):
    """A result file the plots cannot read: names the file, the field and what it should be."""


@dataclass(frozen=True)
class Result:
    """One dated result file."""

    path: Path
    bench: str
    date: str
    page: str
    source: str
    data: dict[str, Any]

    @property
    def label(self) -> str:
        return self.date


def _check(value: Any, schema: Any, where: str) -> None:
    if isinstance(schema, dict) and list(schema) == [str]:
        if not isinstance(value, dict) or not value:
            raise ResultsError(f"{where} should be a non-empty object of names to values, got {value!r}")
        for key, item in value.items():
            _check(item, schema[str], f"{where}.{key}")
    elif isinstance(schema, dict):
        if not isinstance(value, dict):
            raise ResultsError(f"{where} should be an object, got {value!r}")
        for key, item_schema in schema.items():
            if key not in value:
                raise ResultsError(f"{where} lacks the field {key!r}")
            _check(value[key], item_schema, f"{where}.{key}")
    elif isinstance(schema, list):
        if not isinstance(value, list) or not value:
            raise ResultsError(f"{where} should be a non-empty list, got {value!r}")
        for i, item in enumerate(value):
            _check(item, schema[0], f"{where}[{i}]")
    else:
        kinds = schema if isinstance(schema, tuple) else (schema,)
        if isinstance(value, bool) or not isinstance(value, kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ResultsError(f"{where} should be {names}, got {value!r}")


def load(path: Path) -> Result:
    """Read and check one result file: its name is `<date>-<bench>.json` and agrees with its fields."""
    name = FILENAME.match(path.name)
    if not name:
        raise ResultsError(f"{path.name}: a result file is named <YYYY-MM-DD>-<bench>.json")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path.name}: not JSON ({exc})") from None
    _check(data, {"bench": str, "date": str, "page": str, "source": str}, path.name)
    for key in ("bench", "date"):
        if data[key] != name[key]:
            raise ResultsError(f"{path.name}: {key} is {data[key]!r} but the file name says {name[key]!r}")
    if data["bench"] not in SCHEMAS:
        raise ResultsError(f"{path.name}: bench {data['bench']!r} is none of {sorted(SCHEMAS)}")
    if not data["source"].strip():
        raise ResultsError(f"{path.name}: source should say which page, run and date the numbers come from")
    _check(data, SCHEMAS[data["bench"]], path.name)
    return Result(path, data["bench"], data["date"], data["page"], data["source"], data)


def results(bench: str, root: Path = RESULTS) -> list[Result]:
    """Every result file of `bench` under `root`, oldest first."""
    found = [load(p) for p in sorted(root.glob("*.json"))]
    return sorted((r for r in found if r.bench == bench), key=lambda r: r.date)


# ---------------------------------------------------------------------------------------------- drawing

STYLE = {
    "svg.fonttype": "none",  # text stays text: small files, the browser's fonts
    "svg.hashsalt": "varuna-docs",  # the same SVG for the same data, build after build
    "font.family": "sans-serif",
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "legend.frameon": False,
}


def _colors(names: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    palette = colormaps["tab10"]
    return {name: palette(i % 10) for i, name in enumerate(names)}


def _ordered(seen: list[list[str]]) -> list[str]:
    out: list[str] = []
    for names in seen:
        for name in names:
            if name not in out:
                out.append(name)
    return out


def draw_pipeline_ratios(found: list[Result]) -> Any:
    """Per schedule over the dated runs: torch.pipelining's step over Varuna's at the same schedule,
    and torch's 1F1B step over each Varuna schedule's, against the 1.10 goal."""
    from matplotlib.figure import Figure

    runs = [(r, run) for r in found for run in r.data["runs"]]
    labels = [f"{r.date[5:]}\n#{run['run']}" for r, run in runs]
    x = list(range(len(runs)))
    over = _ordered([list(run["over_torch_1f1b"]["varuna"]) for _, run in runs])
    colors = _colors(over + [n for n in _ordered([list(run["pairs"]) for _, run in runs]) if n not in over])
    fig = Figure(figsize=(10, 4.2))
    pairs_ax, over_ax = fig.subplots(1, 2)
    for name in _ordered([list(run["pairs"]) for _, run in runs]):
        y = [run["pairs"].get(name, math.nan) for _, run in runs]
        pairs_ax.plot(x, y, marker="o", ms=4, color=colors[name], label=name)
    pairs_ax.axhline(1.0, color="0.3", lw=1, ls=":")
    pairs_ax.set_title("same schedule: torch.pipelining step / Varuna step")
    for name in over:
        y = [run["over_torch_1f1b"]["varuna"].get(name, math.nan) for _, run in runs]
        over_ax.plot(x, y, marker="o", ms=4, color=colors[name], label=name)
    goal = found[-1].data["goal_over_torch_1f1b"]
    over_ax.axhline(goal, color="0.3", lw=1, ls="--")
    over_ax.annotate(
        f"goal {goal:.2f}", (x[-1], goal), xytext=(8, -3), textcoords="offset points", fontsize=8
    )
    over_ax.axhline(1.0, color="0.3", lw=1, ls=":")
    over_ax.set_title("torch.pipelining's 1F1B step / Varuna's step")
    for ax in (pairs_ax, over_ax):
        ax.set_xticks(x, labels)
        ax.set_xlabel("run (date, number)")
        ax.set_ylabel("ratio (> 1: Varuna faster)")
    over_ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def draw_memory_growth(found: list[Result]) -> Any:
    """The newest run: each rank's growth at each P, Varuna's beside its estimate and beside
    torch.pipelining's rank of the same layers, against the whole model in one process."""
    from matplotlib.figure import Figure

    latest = found[-1]
    ranks = latest.data["ranks"]
    varuna = [r for r in ranks if r["system"] == "Varuna"]
    torch = {(r["P"], r["rank"]): r for r in ranks if r["system"] != "Varuna"}
    x = list(range(len(varuna)))
    width = 0.27
    fig = Figure(figsize=(9, 3.8))
    ax = fig.subplots()
    ax.bar([i - width for i in x], [r["growth"] for r in varuna], width, label="Varuna: growth (measured)")
    ax.bar(
        x,
        [r["estimate"] or 0 for r in varuna],
        width,
        label="Varuna: estimate",
        color="tab:orange",
        alpha=0.8,
    )
    for i, r in enumerate(varuna):
        if r["estimate"] is not None and r["error_pct"] is not None:
            ax.annotate(
                f"{r['error_pct']:+g}%",
                (i, r["estimate"]),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
            )
    other = [torch.get((r["P"], r["rank"])) for r in varuna]
    ax.bar(
        [i + width for i, t in zip(x, other) if t],
        [t["growth"] for t in other if t],
        width,
        label="torch.pipelining: growth",
        color="tab:gray",
    )
    whole = latest.data["whole_model_growth"]
    ax.axhline(whole, color="0.3", lw=1, ls="--")
    ax.annotate(
        "the whole model in one process",
        (len(x) - 0.5, whole),
        xytext=(0, 3),
        textcoords="offset points",
        ha="right",
        fontsize=8,
    )
    ax.set_ylim(0, whole * 1.15)
    ax.set_xticks(x, [f"P = {r['P']}\nrank {r['rank']}" for r in varuna])
    ax.set_ylabel(f"peak - baseline ({latest.data['unit']})")
    ax.set_title(f"memory per rank, {latest.date} (the estimate's error above its bar)")
    ax.legend(loc="upper right", bbox_to_anchor=(1.0, 0.84), fontsize=8)
    return fig


def draw_planner_accuracy(found: list[Result]) -> Any:
    """Each run of the accuracy bench: mean and max |error| of the predicted step, the rank
    correlation and the predicted best's gap, against the bench's targets, coloured by cost model."""
    from matplotlib.figure import Figure

    runs = [(r, run) for r in found for run in r.data["runs"]]
    models = _ordered([[run["model"] for _, run in runs]])
    colors = _colors(models)
    targets = found[-1].data["targets"]
    fig = Figure(figsize=(10, 4.0))
    err_ax, rho_ax, gap_ax = fig.subplots(1, 3)
    x = list(range(1, len(runs) + 1))
    for model in models:
        xs = [i for i, (_, run) in zip(x, runs) if run["model"] == model]
        mine = [run for _, run in runs if run["model"] == model]
        c = colors[model]
        err_ax.plot(xs, [r["mean_abs_error_pct"] for r in mine], "o", color=c, label=model)
        err_ax.plot(xs, [r["max_abs_error_pct"] for r in mine], "^", color=c, mfc="none")
        rho_ax.plot(xs, [r["spearman"] for r in mine], "o", color=c)
        gap_ax.plot(xs, [r["best_gap_pct"] for r in mine], "o", color=c)
    for ax, value, what in (
        (err_ax, targets["mean_abs_error_pct"], "mean target"),
        (err_ax, targets["max_abs_error_pct"], "max target"),
        (rho_ax, targets["spearman"], "target"),
        (gap_ax, targets["best_gap"] * 100, "target"),
    ):
        ax.axhline(value, color="0.3", lw=1, ls="--")
        ax.annotate(what, (x[0], value), xytext=(0, 2), textcoords="offset points", fontsize=8)
    err_ax.set_title("|error| of the predicted step (%)\n● mean  △ max")
    rho_ax.set_title("Spearman rank correlation\n(predicted vs measured order)")
    gap_ax.set_title("best_gap (%): the predicted best's\nmeasured step over the measured best's")
    dates = sorted({r.date for r, _ in runs})
    for ax in (err_ax, rho_ax, gap_ax):
        ax.set_xticks(x)
        ax.set_xlabel(f"run ({', '.join(dates)})")
    fig.legend(*err_ax.get_legend_handles_labels(), loc="lower center", ncols=1, fontsize=8)
    fig.subplots_adjust(bottom=0.3, wspace=0.3, top=0.84)
    return fig


def draw_planner_scale(found: list[Result]) -> Any:
    """The newest at-scale plan: samples/s of the chosen shape per GPU count, and what the step loses
    to the bubble, the stage imbalance and the all-reduce."""
    from matplotlib.figure import Figure

    latest = found[-1]
    rows = latest.data["rows"]
    gpus = [r["gpus"] for r in rows]
    fig = Figure(figsize=(10, 3.8))
    rate_ax, share_ax = fig.subplots(1, 2)
    rate_ax.plot(gpus, [r["samples_per_s"] for r in rows], "o-")
    for i, r in enumerate(rows):
        left = i >= len(rows) / 2  # labels off the line: below-right first, above-left near the edge
        rate_ax.annotate(
            r["shape"].split(" (")[0],
            (r["gpus"], r["samples_per_s"]),
            xytext=(-5, 4) if left else (5, -9),
            textcoords="offset points",
            ha="right" if left else "left",
            fontsize=7,
        )
    rate_ax.set_xscale("log", base=2)
    rate_ax.set_yscale("log", base=2)
    rate_ax.set_xticks(gpus, [str(g) for g in gpus])
    rate_ax.set_yticks(ticks := [2**i for i in range(2, 9)], [str(v) for v in ticks])
    rate_ax.set_xlabel("GPUs")
    rate_ax.set_ylabel("predicted samples/s")
    rate_ax.set_title(f"planned throughput, P × D × micro-batch ({latest.date})")
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for key, label in (
        ("bubble_pct", "bubble"),
        ("imbalance_pct", "imbalance"),
        ("allreduce_pct", "all-reduce"),
    ):
        values = [r[key] for r in rows]
        share_ax.bar(x, values, 0.6, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    share_ax.set_xticks(x, [str(g) for g in gpus])
    share_ax.set_xlabel("GPUs")
    share_ax.set_ylabel("% of the step")
    share_ax.set_title("where the planned step goes")
    share_ax.legend(loc="upper left", fontsize=8)
    return fig


def draw_network_throughput(found: list[Result]) -> Any:
    """The newest run: samples/s of each system and shape against the link's rate (log axis; the
    unshaped link drawn 4x beyond the fastest shaped rate), the crossover marked."""
    from matplotlib.figure import Figure

    latest = found[-1]
    points = latest.data["points"]
    shaped = [p["rate_mbit"] for p in points if p["rate_mbit"] is not None]
    top = 4 * max(shaped) if shaped else 1000.0
    x = [top if p["rate_mbit"] is None else p["rate_mbit"] for p in points]
    names = _ordered([list(p["samples_per_s"]) for p in points])
    colors = _colors(names)
    fig = Figure(figsize=(9, 4.2))
    ax = fig.subplots()
    for name in names:
        y = [p["samples_per_s"].get(name, math.nan) for p in points]
        style = "-" if name.startswith("Varuna") else "--"
        ax.plot(x, y, style, marker="o", ms=4, color=colors[name], label=name)
    crossing = latest.data["crossover_mbit"]
    if crossing is not None:
        ax.axvline(crossing, color="0.3", lw=1, ls=":")
        ax.annotate(
            f"crossover {crossing:g} Mbit/s",
            (crossing, 0),
            xycoords=("data", "axes fraction"),
            xytext=(4, 6),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_xticks(x, ["unshaped" if p["rate_mbit"] is None else f"{p['rate_mbit']:g}" for p in points])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("link rate between the two hosts (Mbit/s)")
    ax.set_ylabel(latest.data["unit"])
    ax.set_title(f"4 ranks on 2 hosts, one shaped link ({latest.date})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return fig


def _grouped_bars(ax: Any, runs: list[dict[str, Any]], field: str) -> None:
    """One group of bars per run, one bar per key of the runs' `field` dicts (in the order first
    seen, the same colour in every group), the runs' names under the groups."""
    keys = _ordered([list(run[field]) for run in runs])
    colors = _colors(keys)
    width = 0.8 / len(keys)
    for i, run in enumerate(runs):
        for j, key in enumerate(keys):
            value = run[field].get(key)
            if value is not None:
                x = i + (j - (len(keys) - 1) / 2) * width
                ax.bar(x, value, width * 0.9, color=colors[key], label=key if i == 0 else None)
    ax.set_xticks(range(len(runs)), [run["run"] for run in runs])


def draw_spot_goodput(found: list[Result]) -> Any:
    """Each run of the spot bench: the goodput of the elastic job and of the baselines beside the
    ideal of the trace (dashed), samples/s."""
    from matplotlib.figure import Figure

    runs = [run for r in found for run in r.data["runs"]]
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    _grouped_bars(ax, runs, "goodput")
    for i, run in enumerate(runs):
        ax.hlines(run["ideal"], i - 0.45, i + 0.45, colors="0.3", linestyles="--", lw=1)
    ax.set_ylabel(f"goodput ({found[-1].data['unit']})")
    ax.set_title("goodput over the trace; dashed: the ideal")
    ax.legend(fontsize=8, loc="lower right")
    return fig


def draw_checkpoint_cost(found: list[Result]) -> Any:
    """Each run of the checkpoint bench: the mean step with no checkpoint, background ones and
    blocking ones (the checkpoint call included), milliseconds."""
    from matplotlib.figure import Figure

    runs = [run for r in found for run in r.data["runs"]]
    fig = Figure(figsize=(8, 3.4))
    ax = fig.subplots()
    _grouped_bars(ax, runs, "step_ms")
    ax.set_ylim(0, 1.25 * max(v for run in runs for v in run["step_ms"].values()))
    ax.set_ylabel(f"mean step ({found[-1].data['unit']})")
    ax.set_title("one rank's step with a checkpoint every 5 steps")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    return fig


@dataclass(frozen=True)
class Plot:
    """A figure of a benchmark page: which result files it draws, how, and its caption."""

    bench: str
    draw: Callable[[list[Result]], Any]
    caption: str


PLOTS: dict[str, Plot] = {
    "pipeline-ratios": Plot(
        "pipeline",
        draw_pipeline_ratios,
        "Varuna against torch.pipelining per schedule over the dated runs (P = 2, M = 8): left, the "
        "same-schedule pairs; right, each Varuna schedule against torch.pipelining's 1F1B.",
    ),
    "memory-growth": Plot(
        "memory",
        draw_memory_growth,
        "Each rank's memory growth at P = 1, 2 and 4: measured, the engine's estimate, and "
        "torch.pipelining's rank of the same layers (newest run).",
    ),
    "planner-accuracy": Plot(
        "planner",
        draw_planner_accuracy,
        "The planner's accuracy per run of the bench, against its targets. The page gives each run's "
        "summary; each configuration's predicted and measured step is in the bench's JSON report.",
    ),
    "planner-scale": Plot(
        "planner-scale",
        draw_planner_scale,
        "The plans for 8 to 1024 GPUs: predicted throughput and the step's losses (newest run).",
    ),
    "spot-goodput": Plot(
        "spot",
        draw_spot_goodput,
        "Goodput of the elastic job, of restart-only and of a static job over the same trace, each run "
        "beside the trace's ideal (dashed).",
    ),
    "checkpoint-cost": Plot(
        "checkpoint",
        draw_checkpoint_cost,
        "One rank's mean step (the checkpoint call included) without checkpoints, with background ones "
        "and with blocking ones, a checkpoint every 5 steps, each run.",
    ),
    "network-throughput": Plot(
        "network",
        draw_network_throughput,
        "Samples/s of Varuna's shapes, DDP and torch.pipelining as the link between the two hosts "
        "slows (newest run).",
    ),
}


def render(name: str, root: Path = RESULTS) -> bytes:
    """The SVG of plot `name`, drawn from the result files under `root`."""
    import matplotlib

    plot = PLOTS[name]
    found = results(plot.bench, root)
    if not found:
        raise ResultsError(f"plot {name!r}: no result file of bench {plot.bench!r} in {root}")
    with matplotlib.rc_context(STYLE):
        fig = plot.draw(found)
        out = io.BytesIO()
        fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    return out.getvalue()


def figure_markdown(name: str, page_uri: str, root: Path = RESULTS) -> str:
    """What replaces `<!-- plot: NAME -->` on the page at `page_uri` (relative to docs/)."""
    if name not in PLOTS:
        raise ResultsError(f"{page_uri}: <!-- plot: {name} --> names no plot; plots: {sorted(PLOTS)}")
    plot = PLOTS[name]
    here = posixpath.dirname(page_uri) or "."
    docs = root.parent.parent
    files = [
        f"[{r.path.name}]({posixpath.relpath(r.path.relative_to(docs).as_posix(), here)})"
        for r in results(plot.bench, root)
    ]
    image = posixpath.relpath(f"{IMG_DIR}/{name}.svg", here)
    return f"![{plot.caption}]({image})\n\n*{plot.caption} Drawn from {', '.join(files)}.*"


# ----------------------------------------------------------------------------------------- MkDocs hooks


def on_files(files: Any, config: Any) -> Any:
    """Add each plot's SVG to the site as a generated file, so pages link it like any image."""
    from mkdocs.exceptions import PluginError
    from mkdocs.structure.files import File

    for name in PLOTS:
        try:
            svg = render(name)
        except ResultsError as exc:
            raise PluginError(f"docs/hooks/plots.py: {exc}") from None
        files.append(File.generated(config, f"{IMG_DIR}/{name}.svg", content=svg))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each `<!-- plot: NAME -->` line with the figure and its caption."""
    from mkdocs.exceptions import PluginError

    try:
        return MARKER.sub(lambda m: figure_markdown(m["name"], page.file.src_uri), markdown)
    except ResultsError as exc:
        raise PluginError(f"docs/hooks/plots.py: {exc}") from None
