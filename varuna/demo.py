"""`make demo`: a ~10M-parameter GPT (tied embeddings, causal mask) trained on a synthetic corpus.

    varuna run --pipeline 2 --data 2 -m varuna.demo [--steps 30] [--schedule varuna] [--model small]

It resumes where a checkpoint left off (the workbench and `varuna run --elastic` relaunch it with
VARUNA_RESUME set), so a resized job continues the same loss curve.

Rank 0 shows a progress bar and ends with a summary: the loss, samples/s, and where each stage's
time went (compute, communication, idle).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, GPTConfig, count_parameters, gpt_demo
from varuna.schedule import SCHEDULES


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="varuna.demo", description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES))
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument(
        "--model",
        default="demo",
        choices=["demo", "small"],
        help="demo: ~10M parameters; small: ~0.4M, for notebooks in tests",
    )
    ap.add_argument(
        "--pause", type=float, default=0.0, help="seconds to sleep after each step (to watch it live)"
    )
    ap.add_argument("--corpus-vocab", type=int, default=512, help="distinct tokens in the synthetic corpus")
    return ap.parse_args(argv)


def summary(engine: Varuna, histories: list[list[dict[str, float]]], losses: list[float], params: int) -> str:
    cfg = engine.config
    steady = slice(1, None) if len(losses) > 1 else slice(None)
    step_s = statistics.median(h["time_s"] for h in histories[0][steady])
    lines = [
        "",
        f"GPT, {params / 1e6:.1f}M parameters — {cfg.pipeline} stages x {cfg.data} replicas, {cfg.schedule}, "
        f"{cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} per replica, {cfg.precision}",
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps",
        f"{cfg.global_batch_size / step_s:.1f} samples/s ({step_s:.3f} s/step, median after the first step)",
        "time per step by stage (mean over replicas):   compute     comm      idle",
    ]
    for s in range(cfg.pipeline):
        ranks = [r * cfg.pipeline + s for r in range(cfg.data)]
        row = {
            k: statistics.mean(statistics.mean(h[k] for h in histories[r][steady]) for r in ranks)
            for k in ("time_s", "compute_s", "comm_s", "idle_s")
        }
        total = row["time_s"] or 1.0
        lines.append(
            f"  stage {s}:{'':36}"
            + "".join(
                f"{row[k]:6.3f}s {100 * row[k] / total:3.0f}%" for k in ("compute_s", "comm_s", "idle_s")
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    torch.manual_seed(0)
    cfg = (
        gpt_demo()
        if args.model == "demo"
        else GPTConfig(vocab_size=1024, seq_len=32, d_model=64, n_layer=6, n_head=4)
    )
    model = GPT(cfg)
    params = count_parameters(model)
    # The corpus uses 512 of the model's 8192 token ids: a loss drop visible within a few dozen steps.
    dataset = SyntheticLM(args.corpus_vocab, cfg.seq_len, 4096, seed=0)
    engine = Varuna(
        model,
        global_batch_size=args.global_batch,
        micro_batch_size=args.micro_batch,
        schedule=args.schedule,
        precision=args.precision,
        example_batch=collate([dataset[i] for i in range(args.micro_batch)]),
        clip_grad_norm=1.0,
    )
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=args.lr))
    if engine.rank == 0:
        print(engine.describe(), flush=True)
    bar: Any = None
    if engine.rank == 0:
        from tqdm import tqdm

        bar = tqdm(
            total=args.steps,
            initial=engine.step_count,
            desc="training",
            unit="step",
            file=sys.stderr,
            mininterval=0.5,
        )
    losses = []
    for step in range(engine.step_count, args.steps):
        losses.append(engine.step(engine.batch(dataset, step)))
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update()
        if args.pause:
            time.sleep(args.pause)
    if bar is not None:
        bar.close()
    histories: list[Any] = [None] * engine.world_size
    dist.all_gather_object(histories, engine.history)
    if engine.rank == 0 and losses:
        print(summary(engine, histories, losses, params), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
