"""Trains every (P x D, model, schedule) of one world size; saves losses and parameters per rank.

Run as `varuna run --pipeline W --data 1 tests/scripts/transparency_worker.py OUT W`: one job
serves every P x D with P * D == W, so the suite starts processes once per world size.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import (  # noqa: E402
    BUCKET_MB,
    CHUNK_CONFIGS,
    CLIP,
    CONFIGS,
    EXTRA,
    GLOBAL_BATCH,
    MICRO_BATCH,
    MODELS,
    SCHEDULES,
    STEPS,
    build,
    dataset,
    engine_options,
    optimizer,
    varlen,
)

from varuna import Varuna  # noqa: E402
from varuna.data import collate  # noqa: E402
from varuna.schedule import peak_inflight  # noqa: E402

out, world = Path(sys.argv[1]), int(sys.argv[2])


def engine_for(kind: str, P: int, D: int, **kw: object) -> tuple[Varuna, object]:
    data = dataset(kind)
    engine = Varuna(
        build(kind),
        pipeline=P,
        data=D,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
        bucket_mb=BUCKET_MB,  # several buckets per stage: they start one by one as they are final
        **kw,  # type: ignore[arg-type]
    )
    return engine, data


runs = [(P, D, part, kind, s) for P, D, part in CONFIGS[world] for kind in MODELS for s in SCHEDULES]
runs += [(P, D, "balanced", kind, s) for P, D, kind, s in EXTRA.get(world, [])]
runs += [
    (P, D, part, k, s)
    for P, D, part, kinds, scheds in CHUNK_CONFIGS.get(world, [])
    for k in kinds
    for s in scheds
]
released: list[dict[str, object]] = []  # after each run's engine.close()
for P, D, partition, kind, schedule in runs:
    engine, data = engine_for(kind, P, D, partition=partition, **engine_options(schedule))
    engine.set_optimizer(optimizer(engine.parameters()))
    losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
    uneven = "" if partition == "balanced" or P == 3 else "-uneven"
    tag = out / f"{kind}-{P}x{D}{uneven}-{schedule}"
    tag.mkdir(parents=True, exist_ok=True)
    params = {n: p.detach().clone() for n, p in engine.named_parameters()}
    in_memory = sorted(n for n, p in engine.model.named_parameters() if not p.is_meta)
    torch.save(
        {
            "losses": losses,
            "params": params,
            "boundaries": engine.partition.boundaries,
            "in_memory": in_memory,
            "stage": engine.stage,
            "chunk_stages": engine.chunk_stages,
            "split": engine.last_times.split if engine.last_times is not None else 0,
            "weights": sum(a.kind == "W" for a in engine.actions),  # weight halves in its list
            "peak_held": peak_inflight(engine.last_times.spans) if engine.last_times is not None else 0,
            "microbatches": engine.config.num_microbatches,
            "refit": engine.refit_info,  # zb-h1, zb-v: the order refitted to measured costs
            "buckets": len(engine._buckets.buffers),
            "started_early": engine._buckets.started_early,  # the last step's, before its ALLREDUCE
            "started_in_backward": engine._buckets.started_in_backward,
            "serial": engine._courier is not None,
        },
        tag / f"rank{engine.rank}.pt",
    )
    engine.close()
    # What a closed engine leaves behind: it must be collectable, and its groups' threads and sockets gone.
    rank, gone = engine.rank, weakref.ref(engine)
    del engine
    gc.collect()
    released.append(
        {
            "alive": gone() is not None,
            "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")),
        }
    )
(out / f"released-rank{rank}.json").write_text(json.dumps(released))

if world == 2:
    # Checkpoints are keyed by parameter name: a zb-v checkpoint resumes under interleaved-1f1b (other
    # chunks, other placement), whose checkpoint resumes under 1f1b; interleaved with recompute too.
    ckpt = out / "chunked-ckpt"
    path = None
    losses = []
    for schedule, steps, kw in (
        ("zb-v", 2, {}),
        ("interleaved-1f1b", 2, {"recompute": True}),
        ("1f1b", 1, {}),
    ):
        engine, data = engine_for("gpt", 2, 1, schedule=schedule, resume=path, **kw)
        engine.set_optimizer(optimizer(engine.parameters()))
        start = engine.step_count
        losses += [engine.step(engine.batch(data, k)) for k in range(start, start + steps)]
        path = engine.checkpoint(ckpt / schedule)
        params = {n: p.detach().clone() for n, p in engine.named_parameters()}
        engine.close()
    torch.save({"losses": losses, "params": params}, out / f"chunk-resume-rank{engine.rank}.pt")

    # Activations whose shape changes every step (the sequence length grows).
    engine, data = engine_for("gpt", 2, 1, schedule="varuna")
    engine.set_optimizer(optimizer(engine.parameters()))
    losses = [engine.step(varlen(engine.batch(data, k), k)) for k in range(STEPS)]
    params = {n: p.detach().clone() for n, p in engine.named_parameters()}
    torch.save({"losses": losses, "params": params}, out / f"varlen-rank{engine.rank}.pt")
    engine.close()
    # Two separate Parameters declared one weight: trains exactly like the tied model.
    data = dataset("gpt")
    engine = Varuna(
        build("gpt-untied"),
        pipeline=2,
        data=1,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
        shared_weights=[("wte.weight", "lm_head.weight")],
    )
    engine.set_optimizer(optimizer(engine.parameters()))
    losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
    params = {n: p.detach().clone() for n, p in engine.named_parameters()}
    torch.save({"losses": losses, "params": params}, out / f"shared-rank{engine.rank}.pt")
    engine.close()

    # A stage boundary inside a block (between its attention and its MLP): cut 0 is inside block 0,
    # cut 2 inside block 1.
    for boundary, schedule in ((0, "1f1b"), (2, "varuna")):
        engine, data = engine_for("gpt-midcut", 2, 1, schedule=schedule, partition=[boundary])
        engine.set_optimizer(optimizer(engine.parameters()))
        losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
        params = {n: p.detach().clone() for n, p in engine.named_parameters()}
        torch.save({"losses": losses, "params": params}, out / f"midcut{boundary}-rank{engine.rank}.pt")
        engine.close()

if world == 4:
    # Clipping by the global norm over all stages and replicas.
    engine, data = engine_for("gpt", 2, 2, schedule="varuna", clip_grad_norm=CLIP)
    engine.set_optimizer(optimizer(engine.parameters()))
    losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
    params = {n: p.detach().clone() for n, p in engine.named_parameters()}
    torch.save({"losses": losses, "params": params}, out / f"clip-rank{engine.rank}.pt")
    engine.close()
    # Gradients all-reduced as bfloat16 copies (`allreduce_dtype="bf16"`): close to plain training,
    # not equal to it.
    engine, data = engine_for("gpt", 2, 2, schedule="1f1b", allreduce_dtype="bf16")
    engine.set_optimizer(optimizer(engine.parameters()))
    losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
    params = {n: p.detach().clone() for n, p in engine.named_parameters()}
    torch.save({"losses": losses, "params": params}, out / f"bf16-allreduce-rank{engine.rank}.pt")
    engine.close()
    # Mixed precision at 2x2: bf16 and fp16 train; a provoked fp16 overflow skips everywhere.
    for precision in ("bf16", "fp16"):
        engine, data = engine_for("gpt", 2, 2, schedule="1f1b", precision=precision)
        engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=3e-3))
        losses = [engine.step(engine.batch(data, k % 4)) for k in range(12)]
        result: dict[str, object] = {"losses": losses}
        if precision == "fp16":
            assert engine.scaler is not None
            before = {n: p.detach().clone() for n, p in engine.named_parameters()}
            scale = engine.scaler.scale
            if engine.rank == 3:  # provoke on one rank only: the decision must still be global
                engine.scaler.scale = 2.0**120
            engine.step(engine.batch(data, 0))
            after = dict(engine.named_parameters())
            result |= {
                "skipped": engine.last_step_skipped,
                "unchanged": all(torch.equal(before[n], after[n]) for n in before),
                "scale_before": scale,
                "scale_after": engine.scaler.scale,
            }
            engine.scaler.scale = scale * engine.scaler.backoff_factor  # rank 3 rejoins the others
            engine.step(engine.batch(data, 1))
            result["next_skipped"] = engine.last_step_skipped
        (out / f"{precision}-rank{engine.rank}.json").write_text(json.dumps(result))
        engine.close()
print("transparency worker done", flush=True)
