"""The network benchmark's figure: samples/s against the link's rate, one line per system and shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from varuna.bench.network.report import label

__all__ = ["write_plot", "rate_positions"]


def rate_positions(rates: list[float | None]) -> tuple[list[float], list[str]]:
    """Where each rate goes on a log axis, and its tick label: the shaped rates at their value, the
    unshaped link 4x beyond the fastest (at 1000 Mbit/s where none is shaped).

    >>> rate_positions([None, 1000.0, 20.0])
    ([4000.0, 1000.0, 20.0], ['unshaped', '1000', '20'])
    """
    shaped = [r for r in rates if r is not None]
    top = 4 * max(shaped) if shaped else 1000.0
    return [top if r is None else r for r in rates], ["unshaped" if r is None else f"{r:g}" for r in rates]


def write_plot(report: dict[str, Any], path: Path) -> Path:
    """Draw the report's points into `path` (PNG) and return it."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    points = report["points"]
    x, ticks = rate_positions([p["rate_mbit"] for p in points])
    names: list[str] = []
    for point in points:
        names += [label(r) for r in point["results"] if label(r) not in names]
    fig = Figure(figsize=(9, 4.6))
    ax = fig.subplots()
    for name in names:
        y = [
            next((r["samples_per_s"] for r in p["results"] if label(r) == name), float("nan")) for p in points
        ]
        style = "--" if not name.startswith("varuna") else "-"
        ax.plot(x, y, style, marker="o", ms=4, label=name)
    crossing = report.get("crossover_mbit")
    if crossing is not None:
        ax.axvline(crossing, color="0.4", lw=1, ls=":")
        ax.annotate(
            f"crossover {crossing:g} Mbit/s",
            (crossing, 0),
            xycoords=("data", "axes fraction"),
            xytext=(4, 6),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_xticks(x, ticks)
    ax.minorticks_off()
    ax.set_xlabel("link rate between the two hosts (Mbit/s, tc tbf)")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    cfg = report["model"]["config"]
    ax.set_title(
        f"4 ranks on 2 hosts: GPT {report['model']['params'] / 1e6:.1f}M params (seq {cfg['seq_len']}), "
        f"global batch {report['global_batch']}"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
