"""Planning at scale, on paper: a GPU cost table of a GPT worked out from its shape, and how long
`varuna plan` takes on it for 8 ... 1024 GPUs (`python -m varuna.bench planner --scale`).

The table is what `varuna profile` would write for the model on one host of GPUs, computed instead
of measured (no such host here): per block, forward FLOPs = 2 x parameters x tokens + the attention
scores (4 x seq x d_model x tokens), run at `flops` per second times an efficiency that grows with
the micro-batch size (a small micro-batch keeps a GPU less busy), backward twice the forward;
activation memory per sample and block seq x d_model x (34 + 5 heads seq / d_model) bytes in 16-bit
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"); weights,
gradients and Adam state in fp32 (16 bytes per parameter); the value crossing a cut is
seq x d_model x 2 bytes per sample; the host's point-to-point link is NVLink-class (`intra_*`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from varuna.planner.costs import CostTable, NetworkCost, SegmentCost

__all__ = ["PaperGPT", "paper_table", "plan_times", "SCALE_GPUS"]

SCALE_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True, kw_only=True, slots=True)
class PaperGPT:
    """The model and the device of the on-paper profile (defaults: a ~9.9B-parameter GPT)."""

    n_layer: int = 48
    d_model: int = 4096
    n_head: int = 32
    seq: int = 2048
    vocab: int = 50304
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    flops: float = 312e12
    """Peak 16-bit FLOP/s of one device (an A100)."""
    efficiency: float = 0.5
    """Share of the peak a large micro-batch reaches; micro-batch n reaches efficiency x n / (n + 0.5)."""
    intra_latency_s: float = 5e-6
    intra_bandwidth_Bps: float = 150e9


def paper_table(model: PaperGPT | None = None) -> CostTable:
    """The cost table of `model`: one segment per block, the embedding in the first, the head and
    the loss in the last (tied weights: the embedding)."""
    m = model or PaperGPT()
    d, s = m.d_model, m.seq
    block_params = 12 * d * d + 13 * d
    embed_params = m.vocab * d + s * d

    def seconds(flop_per_sample: float, n: int) -> float:
        return flop_per_sample * n / (m.flops * m.efficiency * n / (n + 0.5))

    block_flop = 2 * block_params * s + 4 * s * s * d
    head_flop = 2 * m.vocab * d * s
    act_block = int(s * d * (34 + 5 * m.n_head * s / d))
    cut = s * d * 2
    segments = []
    for j in range(m.n_layer):
        first, last = j == 0, j == m.n_layer - 1
        params = block_params + (embed_params if first else 0) + (2 * d if last else 0)
        flop = block_flop + (head_flop if last else 0)
        act = act_block + (s * m.vocab * 4 if last else 0)  # the last one's fp32 logits
        sizes = m.micro_batch_sizes
        segments.append(
            SegmentCost(
                forward_s={n: seconds(flop, n) for n in sizes},
                backward_s={n: 2 * seconds(flop, n) for n in sizes},
                activation_bytes={n: 0 if last else n * cut for n in sizes},
                activation_memory_bytes={n: n * act for n in sizes},
                param_bytes=4 * params,
                grad_bytes=4 * params,
                optimizer_bytes=8 * params,
                update_s=16 * params / 1.5e12,  # Adam reads and writes ~16 B per parameter at HBM speed
            )
        )
    return CostTable(
        model_signature=f"paper-gpt-{m.n_layer}x{m.d_model}",
        segments=segments,
        network=NetworkCost(p2p_latency_s=m.intra_latency_s, p2p_bandwidth_Bps=m.intra_bandwidth_Bps),
        micro_batch_sizes=list(m.micro_batch_sizes),
        device="cuda:paper A100 (computed, not measured)",
        precision="bf16",
        tied_bytes=4 * m.vocab * d,
    )


def plan_times(table: CostTable, gpus: tuple[int, ...] = SCALE_GPUS, **kw: Any) -> list[dict[str, Any]]:
    """`varuna.planner.search.plan` at each GPU count: the best shape, what limits it, and the
    seconds the search took (`kw` go to `plan`)."""
    from varuna.planner.search import plan

    rows = []
    for n in gpus:
        start = time.perf_counter()
        result = plan(table, gpus=n, **kw)
        took = time.perf_counter() - start
        best = result.best
        rows.append(
            {
                "gpus": n,
                "pipeline": best.pipeline,
                "data": best.data,
                "micro_batch_size": best.micro_batch_size,
                "num_microbatches": best.num_microbatches,
                "schedule": best.schedule,
                "recompute": best.recompute,
                "predicted_step_s": best.predicted_step_s,
                "bubble_fraction": best.bubble_fraction,
                "plan_s": took,
                "candidates": len(result.ranked),
                "rejected": len(result.rejected),
            }
        )
    return rows


def scale_report(*, quick: bool = False) -> dict[str, Any]:
    """`python -m varuna.bench planner --scale`: `plan_times` of the paper GPT for 8..1024 GPUs on
    hosts of 8 (100 Gbit/s between hosts), 80 GiB each, global batch 1024, with what limits each
    plan; `quick`: 256 and 1024 GPUs only. The table is under "table"."""
    from varuna.planner.cluster import Cluster
    from varuna.planner.limits import explain
    from varuna.planner.search import plan

    table = paper_table()
    cluster = Cluster(gpus_per_host=8)
    rows = []
    for n in (256, 1024) if quick else SCALE_GPUS:
        start = time.perf_counter()
        result = plan(table, gpus=n, memory_bytes="80GiB", global_batch_size=1024, cluster=cluster)
        took = time.perf_counter() - start
        best, limits = result.best, explain(result)
        rows.append(
            {
                "gpus": n,
                "pipeline": best.pipeline,
                "data": best.data,
                "micro_batch_size": best.micro_batch_size,
                "num_microbatches": best.num_microbatches,
                "schedule": best.schedule,
                "recompute": best.recompute,
                "predicted_step_s": best.predicted_step_s,
                "samples_per_s": best.samples_per_s,
                "max_memory_bytes": best.max_memory_bytes,
                "shares": limits["shares"],
                "limited_by": limits["limited_by"],
                "fewer_stages": (limits["fewer_stages"] or {}).get("why"),
                "plan_s": took,
                "candidates": len(result.ranked),
                "rejected": len(result.rejected),
            }
        )
    lines = [
        f"{'GPUs':>5} {'P x D x mbs (M)':>20} {'schedule':>14} {'step s':>8} {'samples/s':>9} "
        f"{'bubble':>6} {'imbal':>6} {'allred':>6} {'plan s':>7}  limited by"
    ]
    for r in rows:
        shape = f"{r['pipeline']} x {r['data']} x {r['micro_batch_size']} ({r['num_microbatches']})"
        sched = r["schedule"] + (" +R" if r["recompute"] else "")
        lines.append(
            f"{r['gpus']:>5} {shape:>20} {sched:>14} {r['predicted_step_s']:>8.3f} {r['samples_per_s']:>9.1f} "
            f"{100 * r['shares']['bubble']:>5.0f}% {100 * r['shares']['imbalance']:>5.0f}% "
            f"{100 * r['shares']['allreduce']:>5.0f}% {r['plan_s']:>7.2f}  " + ", ".join(r["limited_by"])
        )
    return {
        "model": f"{table.model_signature}: {sum(s.param_bytes for s in table.segments) / 4e9:.1f}B parameters",
        "hosts": "8 GPUs per host, 100 Gbit/s and 20 us between hosts; NVLink-class within (150 GB/s, 5 us)",
        "memory": "80 GiB per GPU",
        "global_batch_size": 1024,
        "rows": rows,
        "table": "\n".join(lines),
    }
