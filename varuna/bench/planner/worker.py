"""One job of the planner benchmark: every rank runs this module, rank 0 writes the results.

    varuna run -p 4 --run-dir RUN -m varuna.bench.planner.worker SPEC.json     # mode "profile"
    varuna run -p W --run-dir RUN -m varuna.bench.planner.worker SPEC.json     # mode "measure"

    profile   `varuna.profile.measure.run_profile` on every rank: the network along the layouts of 2 and 4
              ranks, the compute slowdown with 1..4 ranks busy, the model on rank 0 ->
              RUN/profile.json
    measure   `rounds` rounds, each first `run_profile` again (network and slowdown of these W
              ranks, the model) and then every configuration of the spec (P x D = W, micro-batch
              size, schedule, recompute and the stage boundaries chosen from the first profile):
              `Varuna(...)` with exactly that choice, AdamW, `warmup` untimed and `steps` timed
              steps, and `varuna.planner.search.predict` of it from the round's profile. A step is timed from
              a barrier to the end of the optimizer step; its time is the slowest rank's. Rank 0
              writes the results to the spec's `out`.

A shared host's speed drifts over minutes even with nothing else running in its VM (other VMs share
the machine): a profile describes the host as it was during the profile. So each round is predicted
from a profile taken just before it, not from one taken minutes earlier.

This host is shared: other people's processes take cores at random times, and a step measured
then says nothing about the planner. So before each round rank 0 waits (up to `quiet_wait_s`)
until other processes use less than `max_foreign` cores, and after it compares the host's busy
CPU time (/proc/stat) with the CPU time of the job's own ranks: a round in which others used more
than `max_foreign` cores is measured again (up to `attempts` times) and, if still disturbed, kept
but flagged. Waiting and measuring again stop once they have taken `retry_budget_s`. Nothing is
rescaled: a measured step time is a plain median of timed steps, a prediction is the planner's.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from varuna.bench.common import forward_backward_s, run_worker
from varuna.bench.load import foreign_cores, host_busy_s, wait_quiet
from varuna.data import SyntheticLM, collate, global_indices
from varuna.models import GPT, GPTConfig

LR = 1e-4
SEED = 0
CORES = os.cpu_count() or 1


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _model(cfg: dict[str, Any]) -> GPT:
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**cfg))


def _batches(spec: dict[str, Any], steps: int) -> list[dict[str, torch.Tensor]]:
    cfg, B = spec["model"], spec["global_batch_size"]
    ds = SyntheticLM(cfg["vocab_size"], cfg["seq_len"], max(B * steps, 256), seed=0)
    return [collate([ds[i] for i in global_indices(s, B, len(ds))]) for s in range(steps)]


def profile(spec: dict[str, Any]) -> None:
    """`run_profile` on every rank; rank 0 writes RUN/profile.json."""
    from varuna import Varuna
    from varuna.profile.measure import run_profile

    run_profile(
        _model(spec["model"]),
        _batches(spec, 1)[0],
        micro_batch_sizes=spec["micro_batch_sizes"],
        repeats=spec["repeats"],
        run_dir=spec["run_dir"],
        progress=False,
        engine=Varuna,
    )


def _share(engine: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This replica's contiguous slice of a global batch (the same samples for every shape)."""
    n = engine.config.global_batch_size // engine.config.data
    return {k: v[engine.replica * n : (engine.replica + 1) * n] for k, v in batch.items()}


def _watched(fn: Callable[[], Any]) -> tuple[Any, float | None]:
    """Collective: `fn()` on every rank, and the cores other processes kept busy meanwhile (host
    busy time on rank 0 minus the CPU time of every rank of the job)."""
    import torch.distributed as dist

    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    busy0, cpu0, t0 = host_busy_s() if rank == 0 else None, time.process_time(), time.perf_counter()
    result = fn()
    dist.barrier()
    wall, busy1 = time.perf_counter() - t0, host_busy_s() if rank == 0 else None
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (time.process_time() - cpu0, busy0, busy1, wall))
    _, busy0, busy1, wall = every[0]  # rank 0's view of the host, the same on every rank
    return result, foreign_cores(busy0, busy1, sum(r[0] for r in every), wall)


def _steps(spec: dict[str, Any], c: dict[str, Any], batches: list[dict[str, torch.Tensor]]) -> list[float]:
    """Build the engine for `c`, run warm-up and timed steps; the slowest rank's timed step times."""
    import torch.distributed as dist

    from varuna import Varuna

    engine = Varuna(
        _model(spec["model"]),
        pipeline=c["pipeline"],
        data=c["data"],
        global_batch_size=spec["global_batch_size"],
        micro_batch_size=c["micro_batch_size"],
        schedule=c["schedule"],
        recompute=c["recompute"],
        partition=c["boundaries"] if c["pipeline"] > 1 else "uniform",
        example_batch=batches[0],
    )
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR))
    times = []
    for batch in batches:
        dist.barrier()
        start = time.perf_counter()
        engine.step(_share(engine, batch))
        times.append(time.perf_counter() - start)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    engine.close()
    slowest = [max(r[i] for r in every) for i in range(len(batches))]
    return [round(t, 5) for t in slowest[spec["warmup"] :]]


def _bracketed_steps(
    spec: dict[str, Any], c: dict[str, Any], batches: list[dict[str, torch.Tensor]], table: Any
) -> tuple[Any, list[float]]:
    """`_steps` of `c` bracketed by two profiles of the model's compute at `c`'s micro-batch size,
    and the round's profile with its per-segment compute replaced by the mean of the two. A shared
    host's speed moves within seconds, so compute timed around a configuration describes the host it
    ran on better than compute timed at the start of the round, or by one profile just before it.
    The network and the slowdown table stay the round's.

    min(W, cores) ranks profile at once and rank 0's times over the round's slowdown at that count
    are the lone compute: one busy core and two do not speed up and slow down alike, so compute
    timed on rank 0 alone can describe another host than the one the configurations of several
    ranks run on."""
    import dataclasses

    import torch.distributed as dist

    from varuna.planner.costs import CostTable
    from varuna.profile.measure import profile_model

    m = c["micro_batch_size"]
    rank, world = dist.get_rank(), dist.get_world_size()
    # k = min(W, cores) ranks profile at once, so the compute is timed with the cores as busy as
    # the job keeps them (the cores do not speed up and slow down alike for one busy rank and for
    # two); rank 0's times over the round's slowdown at k busy are then the lone compute the
    # simulator scales back. More than one rank per core would time-slice the timed passes, so
    # with W > cores the others wait.
    k = min(world, CORES)
    together = k > 1 and k in table.compute_slowdown
    model = _model(spec["model"]) if rank == 0 or (together and rank < k) else None  # left as it was

    def profile() -> Any:
        if model is None:
            return None
        return profile_model(
            model, batches[0], micro_batch_sizes=(m,), repeats=spec["repeats"], progress=False
        )

    dist.barrier()
    before = profile()
    dist.barrier()
    steps = _steps(spec, c, batches)
    dist.barrier()
    after = profile()
    box: list[Any] = [None]
    if rank == 0:
        # the mean of the two profiles, over the round's factor at k busy (1 when rank 0 ran alone)
        scale = 2 * (table.compute_slowdown[k] if together else 1.0)

        def mean(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
            return {n: (a[n] + b[n]) / scale for n in a}

        segments = [
            dataclasses.replace(
                old,
                forward_s=old.forward_s | mean(x.forward_s, y.forward_s),
                backward_s=old.backward_s | mean(x.backward_s, y.backward_s),
                recompute_s=(old.recompute_s or old.forward_s)
                | mean(x.recompute_s or x.forward_s, y.recompute_s or y.forward_s),
                nograd_forward_s=(old.nograd_forward_s or old.forward_s)
                | mean(x.nograd_forward_s or x.forward_s, y.nograd_forward_s or y.forward_s),
                update_s=(x.update_s + y.update_s) / scale,
            )
            for old, x, y in zip(table.segments, before, after)
        ]
        box[0] = dataclasses.replace(table, segments=segments).to_json()
    dist.broadcast_object_list(box, src=0)
    return CostTable.from_json(box[0]), steps


class _Retries:
    """Wait for a quiet host, run, and run again while others disturbed it, within a time budget."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.spare = float(spec["retry_budget_s"])  # seconds this job may spend waiting and redoing

    def run(self, what: str, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
        import torch.distributed as dist

        rank, spec = dist.get_rank(), self.spec
        for attempt in range(1, spec["attempts"] + 1):
            t0 = time.perf_counter()
            wait = min(spec["quiet_wait_s"], max(self.spare, 0.0))
            box = [wait_quiet(spec["max_foreign"], wait) if rank == 0 and wait > 0 else None]
            dist.broadcast_object_list(box, src=0)
            self.spare -= time.perf_counter() - t0
            t0 = time.perf_counter()
            result, load = _watched(fn)
            clean = load is None or load <= spec["max_foreign"]
            if clean or attempt == spec["attempts"] or self.spare <= 0:
                return result, {
                    "foreign_cores": load,
                    "clean": clean,
                    "attempt": attempt,
                    "load_before": box[0],
                }
            self.spare -= time.perf_counter() - t0
            if rank == 0:
                _log(f"{what}: others used {load:.2f} cores; again")
        raise AssertionError("unreachable")


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """`rounds` rounds, each a profile then every configuration of the spec; per configuration and
    round the step times and the prediction from that round's profile."""
    import torch.distributed as dist

    from varuna import Varuna
    from varuna.planner.costs import CostTable
    from varuna.planner.search import predict
    from varuna.profile.measure import run_profile

    rank = dist.get_rank()
    batches = _batches(spec, spec["warmup"] + spec["steps"])
    retries = _Retries(spec)
    rounds: list[list[dict[str, Any]]] = [[] for _ in spec["configs"]]
    profiles = []
    for r in range(spec["rounds"]):

        def measure_costs() -> CostTable:
            return run_profile(
                _model(spec["model"]),
                batches[0],
                micro_batch_sizes=spec["micro_batch_sizes"],
                repeats=spec["repeats"],
                run_dir=spec["run_dir"],
                progress=False,
                engine=Varuna,
            )

        table, seen = retries.run(f"profile of round {r + 1}", measure_costs)
        profiles.append(
            seen
            | {
                "forward_backward_s": _forward_backward(table),
                "slowdown": table.compute_slowdown,
                "delivery_s": table.network.delivery_s,
                "message_cpu": table.network.message_cpu,
                "action_overhead_s": table.action_overhead_s,
            }
        )
        for c, kept in zip(spec["configs"], rounds):
            (fresh, steps), seen = retries.run(
                f"{_name(c)} round {r + 1}", functools.partial(_bracketed_steps, spec, c, batches, table)
            )
            predicted, from_round = (
                predict(
                    t,
                    pipeline=c["pipeline"],
                    data=c["data"],
                    micro_batch_size=c["micro_batch_size"],
                    schedule=c["schedule"],
                    global_batch_size=spec["global_batch_size"],
                    recompute=c["recompute"],
                    boundaries=c["boundaries"],
                ).predicted_step_s
                for t in (fresh, table)
            )
            kept.append(
                seen
                | {"step_s": steps, "predicted_s": predicted, "predicted_s_round_profile": from_round}
                | {"profile_clean": profiles[-1]["clean"]}
            )
            if rank == 0:
                _log(
                    f"{_name(c)} round {r + 1}: median {statistics.median(steps):.4f} s, predicted "
                    f"{predicted:.4f} s (others {seen['foreign_cores'] or 0:.2f} cores)"
                )
    configs = [c | {"rounds": kept} for c, kept in zip(spec["configs"], rounds)]
    return {"configs": configs, "profiles": profiles}


def _forward_backward(table: Any) -> dict[int, float]:
    """Seconds of forward + backward of the whole model per micro-batch size (a host-speed gauge)."""
    return {m: forward_backward_s(table.segments, m) for m in table.micro_batch_sizes}


def _name(c: dict[str, Any]) -> str:
    return f"{c['pipeline']}x{c['data']} mbs {c['micro_batch_size']} {c['schedule']}"


def _run(spec: dict[str, Any]) -> Any:
    if spec["mode"] == "profile":
        profile(spec)  # writes its own files
        return None
    return measure(spec)


def main(argv: list[str]) -> None:
    run_worker(argv, _run)


if __name__ == "__main__":
    main(sys.argv[1:])
