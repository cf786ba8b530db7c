"""GPU check: a short throughput bench of every schedule at one P (D = 1) on the job's device.

    varuna run --pipeline P tests/gpu/_bench_worker.py OUT SIZE WARMUP STEPS

SIZE is "bench" (`gpt_bench()`, global batch 32 in micro-batches of 4) or "tiny" (`gpt_tiny()`
cut inside blocks, batch 8 in micro-batches of 2: a CPU smoke run). Each schedule trains the same
GPT on the same batches with AdamW; a step is timed from a barrier to the end of the optimizer step
(the device synchronised), and its time is the slowest rank's. Then rank 0 alone trains the plain
model for the same steps, accumulating micro-batches of the same size (the others wait): the
one-process time that gives each pipeline's share of its bubble-limited ideal
M / (M + P - 1) * P * single. Rank 0 writes OUT/bench.json. `python -m varuna.bench pipeline` is the
paired CPU bench against torch.distributed.pipelining; this one only needs the engine to run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from varuna import Varuna
from varuna.data import SyntheticLM, collate, global_indices
from varuna.models import GPT, GPTConfig, gpt_bench, gpt_tiny
from varuna.schedule import SCHEDULES

SIZES = {
    "bench": (gpt_bench, 32, 4),
    "tiny": (lambda: dataclasses.replace(gpt_tiny(), cut_inside_blocks=True), 8, 2),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _model(cfg: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


def bench_schedule(
    schedule: str, cfg: GPTConfig, batches: list[dict[str, torch.Tensor]], B: int, mbs: int, warmup: int
) -> dict[str, Any]:
    engine = Varuna(
        _model(cfg),
        global_batch_size=B,
        micro_batch_size=mbs,
        schedule=schedule,
        example_batch=collate([{k: v[i] for k, v in batches[0].items()} for i in range(mbs)]),
    )
    device = engine.device
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=1e-4))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for k, batch in enumerate(batches):
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        losses.append(engine.step(batch))
        _sync(device)
        step_s = _slowest(time.perf_counter() - t0, device)
        if k >= warmup:
            times.append(step_s)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, peak)
    engine.close()
    median = statistics.median(times)
    return {
        "step_s": times,
        "median_step_s": median,
        "samples_per_s": B / median,
        "losses": losses,
        "peak_bytes_per_rank": every,
    }


def bench_single(cfg: GPTConfig, batches: list[dict[str, torch.Tensor]], mbs: int, warmup: int) -> float:
    """Rank 0 alone: the plain model, micro-batches accumulated, one optimizer step per batch."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    model = _model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for k, batch in enumerate(batches):
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        B = batch["input_ids"].shape[0]
        for i in range(0, B, mbs):
            micro = {n: v[i : i + mbs].to(device) for n, v in batch.items()}
            (model(**micro) * (mbs / B)).backward()
        opt.step()
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    out, size, warmup, steps = (
        Path(sys.argv[1]) / "bench.json",
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    make, B, mbs = SIZES[size]
    cfg = make()
    ds = SyntheticLM(cfg.vocab_size, cfg.seq_len, max(B * (warmup + steps), 256), seed=0)
    batches = [collate([ds[i] for i in global_indices(s, B, len(ds))]) for s in range(warmup + steps)]
    P, M = dist.get_world_size(), B // mbs
    only = os.environ.get("BENCH_SCHEDULES")
    results = {
        s: bench_schedule(s, cfg, batches, B, mbs, warmup) for s in (only.split(",") if only else SCHEDULES)
    }
    single = bench_single(cfg, batches, mbs, warmup) if dist.get_rank() == 0 else 0.0
    dist.barrier()
    if dist.get_rank() != 0:
        return
    for r in results.values():  # samples/s over M / (M + P - 1) * P * single's samples/s
        r["share_of_ideal"] = single / (r["median_step_s"] * P * M / (M + P - 1))
    report = {
        "model": dataclasses.asdict(cfg),
        "pipeline": P,
        "global_batch_size": B,
        "micro_batch_size": mbs,
        "warmup": warmup,
        "steps": steps,
        "single_step_s": single,
        "single_samples_per_s": B / single,
        "asked": list(results),
        "schedules": results,
    }
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
