"""One measured job of the pipeline benchmark: every rank runs this module, rank 0 writes the results.

    varuna run --pipeline P -m varuna.bench.pipeline.worker SPEC.json

SPEC.json (written by `varuna.bench.pipeline.driver`) gives the model config, the batch shape, P, the
schedules of each system, whether the one-process baseline joins the rounds, the step counts and
the output file. The job runs every system at that P, schedule by schedule, alternating step by
step (`run_rounds`). Every system trains the same GPT (same seed, so the same initial weights) on
the same global batches with AdamW, one torch thread per rank. A step is timed from a barrier that
lines the ranks up to the end of the optimizer step; its time is the slowest rank's.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from varuna.bench.common import LR, build_model, gather, global_batches, run_worker, worker_log
from varuna.bench.pipeline.torch_baseline import TorchRunner

REFERENCE = "torch.pipelining 1f1b (reference)"
"""torch.pipelining's 1F1B, at its own cut, in the rounds of every other schedule at the paired P
(`spec["reference"]`): the issue's targets compare each system with it step by step."""


def share_of_ideal(step_s: float, single_step_s: float, pipeline: int, microbatches: int) -> float:
    """A pipeline's samples/s over its bubble-limited ideal M / (M + P - 1) * P * (one process's
    samples/s), from the two step times of the same global batch."""
    P, M = pipeline, microbatches
    return single_step_s / (step_s * P * M / (M + P - 1))


class _Clock:
    """Wall and CPU seconds of each step: the process's (all its threads: gloo's too) and the
    calling thread's alone (where every forward, backward and optimizer step runs; never more than
    the wall time)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.thread: list[float] = []

    def start(self) -> None:
        self._t, self._c, self._h = time.perf_counter(), time.process_time(), time.thread_time()

    def stop(self) -> None:
        self.wall.append(time.perf_counter() - self._t)
        self.cpu.append(time.process_time() - self._c)
        self.thread.append(time.thread_time() - self._h)


def _step_peak_bytes(step: Callable[[], object]) -> int | None:
    """How far this process's resident memory rose above where it started during `step()`: its
    activations, gradients and buffers at their peak (Linux: VmHWM reset through clear_refs, after
    freed memory went back to the system). The same measure for every system; None off Linux."""
    import ctypes
    import gc

    def status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise OSError(field)

    try:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        base = status("VmRSS")
    except OSError:
        step()
        return None
    step()
    return max(status("VmHWM") - base, 0)


def _summary(
    step_s: list[float],
    cpu_s: list[list[float]],
    spec: dict[str, Any],
    thread_s: list[list[float]] | None = None,
) -> dict[str, Any]:
    """samples/s from the median timed step (and from the fastest one, less hurt by a noisy host).

    `cpu_s` holds each rank's CPU seconds per step (`thread_s` its main thread's); their medians say
    how much work a rank did, whatever else ran on the host meanwhile.
    """
    w = spec["warmup"]
    timed = step_s[w:]
    median = statistics.median(timed)
    return {
        "samples_per_s": spec["global_batch_size"] / median,
        "best_samples_per_s": spec["global_batch_size"] / min(timed),
        "median_step_s": median,
        "step_s": [round(t, 5) for t in timed],
        "warmup_step_s": [round(t, 5) for t in step_s[:w]],
        "cpu_s_per_step_per_stage": [round(statistics.median(c[w:]), 4) for c in cpu_s],
    } | (
        {}
        if thread_s is None
        else {"thread_cpu_s_per_step_per_stage": [round(statistics.median(c[w:]), 4) for c in thread_s]}
    )


# ------------------------------------------------------------------------------------------ single


class _SingleRunner:
    """Plain training in one process: forward+backward per micro-batch, gradients accumulated.

    Same micro-batch size as the pipelines, so the per-sample compute is the same kernels on the
    same shapes; this is the per-rank ideal the pipelines are compared against. In a job, only
    `active` ranks run it (the others' `step` does nothing).
    """

    def __init__(self, spec: dict[str, Any], *, active: bool = True) -> None:
        self.active = active
        self.mbs = spec["micro_batch_size"]
        self.M = spec["global_batch_size"] // self.mbs
        if active:
            self.model = build_model(spec["model"])
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, batch: dict[str, Tensor]) -> float | None:
        if not self.active:
            return None
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(self.M):
            micro = {k: v[m * self.mbs : (m + 1) * self.mbs] for k, v in batch.items()}
            loss = self.model(**micro) / self.M
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        return total


# ------------------------------------------------------------------------------------------ varuna


class _VarunaRunner:
    """One Varuna engine of the spec's model at one schedule; `step(batch)` returns the loss."""

    def __init__(self, spec: dict[str, Any], schedule: str, example: dict[str, Tensor]) -> None:
        from varuna import Varuna

        self.engine = Varuna(
            build_model(spec["model"]),
            pipeline=spec["pipeline"],
            data=1,
            global_batch_size=spec["global_batch_size"],
            micro_batch_size=spec["micro_batch_size"],
            schedule=schedule,
            example_batch=example,
            partition=_partition(spec, schedule),
            run_dir=spec["run_dir"],  # shares the segment profile (and so the partition) across schedules
        )
        self.engine.set_optimizer(torch.optim.AdamW(self.engine.parameters(), lr=LR))

    def step(self, batch: dict[str, Tensor]) -> float | None:
        return self.engine.step(batch)


# -------------------------------------------------------------------------------- torch.pipelining


def _chunks(schedule: str) -> int:
    from varuna.schedule import schedule_spec

    return schedule_spec(schedule).chunks_per_rank


def _partition(spec: dict[str, Any], schedule: str) -> Any:
    """The spec's partition: "fastest" (each schedule its own cut, fitted by the simulator to the
    profiled costs: `varuna.planner.cuts`), "balanced", or a list of boundaries (one-chunk
    schedules; the others then take "fastest")."""
    chosen = spec.get("partition", "fastest")
    return chosen if isinstance(chosen, str) or _chunks(schedule) == 1 else "fastest"


# -------------------------------------------------------------------------------------------- rounds


def with_single(spec: dict[str, Any], schedule: str) -> bool:
    """Whether the one-process baseline joins the rounds of `schedule`: those of every schedule both
    systems run, or (when they share none) those of the first schedule only."""
    if not spec["single"]:
        return False
    if spec.get("reference"):  # torch's 1F1B carries it to the other rounds (`ref_ratios`)
        return schedule == "1f1b"
    shared = [s for s in spec["varuna_schedules"] if s in spec["torch_schedules"]]
    return schedule in shared if shared else schedule == spec["varuna_schedules"][0]


def run_rounds(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every system of every schedule at one P in this one job, step by step in turn.

    A shared host's speed drifts over minutes, so two jobs a minute apart compare the host as much
    as the systems. Here, for each schedule, step k of each system runs right after step k of the
    others (the order rotating), on the same processes, weights and batches: each round's ratio of
    torch.pipelining's step over Varuna's cancels the drift, and their median is the comparison
    (`pair_ratios`). With `spec["single"]` the baseline ("single": the whole model on rank 0, the
    other ranks waiting at the next barrier) runs in the same rounds, so a pipeline's share of its
    ideal compares it with the host as it was at the same time (`of_ideal_per_round`). With
    `spec["reference"]` torch.pipelining's 1F1B (at its own cut) runs in the rounds of every other
    schedule too, so each system's speed over it is measured step by step (`ref_ratios`), as the
    issue's targets compare them: schedules run minutes apart differ in the baseline's speed alone.
    The baseline then runs in 1F1B's rounds only (it is the slowest step of all), and the other
    shares of the ideal go through the reference: its median share there times each round's ratio
    over it. One job per P also means one start-up per P, not one per system.

    Varuna's engine of each schedule chooses that schedule's boundaries (`spec["partition"]`,
    "fastest" by default: the segment profile is shared, the cut fitted to the schedule), and
    torch.pipelining's stages of the same schedule are cut at the same ones.
    """
    import torch.distributed as dist

    batches = global_batches(spec)
    P, rank = spec["pipeline"], dist.get_rank()
    M = spec["global_batch_size"] // spec["micro_batch_size"]
    w = spec["warmup"]
    varuna_schedules, torch_schedules = spec["varuna_schedules"], spec["torch_schedules"]
    schedules = list(varuna_schedules) + [s for s in torch_schedules if s not in varuna_schedules]
    if spec.get("reference"):  # torch's 1F1B first: its cut is the reference's in the other rounds
        schedules.sort(key=lambda s: s != "1f1b")
    results: list[dict[str, Any]] = []
    ref_share: tuple[float, float] | None = None  # torch 1F1B's median share of the ideal, single's samples/s
    for name in schedules:
        systems: dict[str, _VarunaRunner | TorchRunner | _SingleRunner] = {}
        engine = None
        if name in varuna_schedules:
            runner = _VarunaRunner(spec, name, batches[0])
            engine = runner.engine
            # Varuna's engine cut the model for this schedule: torch.pipelining runs the same cut
            spec.setdefault("boundaries_by_schedule", {})[name] = list(engine.partition.boundaries)
            if rank == 0:
                worker_log(f"P={P} {name}: boundaries {list(engine.partition.boundaries)}")
            systems["varuna"] = runner
        if name in torch_schedules:
            systems["torch.pipelining"] = TorchRunner(spec, name)
        if with_single(spec, name):
            systems["single"] = _SingleRunner(spec, active=rank == 0)
        ref = None if not spec.get("reference") else "torch.pipelining" if name == "1f1b" else REFERENCE
        if ref == REFERENCE:
            systems[REFERENCE] = TorchRunner(spec, "1f1b")
        names = list(systems)
        clocks = {k: _Clock() for k in names}
        losses: dict[str, list[float | None]] = {k: [] for k in names}
        for k, batch in enumerate(batches):
            for system in names[k % len(names) :] + names[: k % len(names)]:
                dist.barrier()
                clocks[system].start()
                losses[system].append(systems[system].step(batch))
                clocks[system].stop()
        peaks = {}
        for system in [n for n in names if n != REFERENCE]:  # one more step each, untimed: its peak memory
            dist.barrier()
            peaks[system] = _step_peak_bytes(functools.partial(systems[system].step, batches[0]))
        mine = {
            k: {"step_s": c.wall, "cpu_s": c.cpu, "thread_s": c.thread, "losses": losses[k]}
            for k, c in clocks.items()
        }
        fractions = {}
        if engine is not None:
            timed = engine.history[w:]
            total = sum(h["time_s"] for h in timed)
            opening = min(engine.chunk_stages)  # the rank's first virtual stage: its forward opens the fill
            forwards = [
                sp.end - sp.start
                for sp in (engine.last_times.spans if engine.last_times is not None else [])
                if sp.kind == "F" and sp.stage in (None, opening)
            ]
            fractions = {
                "idle": sum(h["idle_s"] for h in timed) / total,
                "comm": sum(h["comm_s"] for h in timed) / total,
                "first_forward_s": statistics.median(forwards) if forwards else 0.0,
                "refit": engine.refit_info,  # zb-h1, zb-v: the order refitted to measured costs
            }
            engine.close()
        every = gather({"systems": mine, "fractions": fractions, "peaks": peaks})
        slowest = {
            k: [max(r["systems"][k]["step_s"][i] for r in every) for i in range(len(batches))] for k in names
        }
        first = {
            k: next(r["systems"][k]["losses"][0] for r in every if r["systems"][k]["losses"][0] is not None)
            for k in names
        }
        baseline = None
        if "single" in systems:
            baseline = _summary(slowest["single"], [every[0]["systems"]["single"]["cpu_s"]], spec)
        for system in ("varuna", "torch.pipelining"):
            if system not in systems:
                continue
            record: dict[str, Any] = {
                "system": system,
                "schedule": name,
                "pipeline": P,
                "microbatches": M,
                **_summary(
                    slowest[system],
                    [r["systems"][system]["cpu_s"] for r in every],
                    spec,
                    [r["systems"][system]["thread_s"] for r in every],
                ),
                "boundaries": spec["boundaries_by_schedule"][name],
                "step_peak_bytes_per_stage": [r["peaks"][system] for r in every],
            }
            if system == "varuna":
                record["idle_fraction_per_stage"] = [round(r["fractions"]["idle"], 4) for r in every]
                record["comm_fraction_per_stage"] = [round(r["fractions"]["comm"], 4) for r in every]
                record["first_forward_s_per_stage"] = [
                    round(r["fractions"]["first_forward_s"], 4) for r in every
                ]
                refit = every[0]["fractions"]["refit"]
                if refit is not None:  # before the timed steps (warm-up >= refit_after): what they ran
                    record["refit"] = {
                        "after_step": refit["step"],
                        "costs_s": [[round(x, 5) for x in row] for row in refit["costs"]],
                        "startup_order_s": refit["startup_order_s"] and round(refit["startup_order_s"], 4),
                        "refitted_order_s": refit["refitted_order_s"] and round(refit["refitted_order_s"], 4),
                    }
            record["first_loss"] = first[system]
            if "varuna" in systems and "torch.pipelining" in systems:
                record["paired"] = True
                record["pair_ratios"] = [
                    round(t / v, 4) for t, v in zip(slowest["torch.pipelining"][w:], slowest["varuna"][w:])
                ]
            if ref is not None:  # torch's 1F1B in the same rounds: this system's speed over it, drift-free
                record["ref_ratios"] = [
                    round(r / x, 4) for r, x in zip(slowest[ref][w:], slowest[system][w:])
                ]
            if baseline is not None:
                record["single_samples_per_s"] = baseline["samples_per_s"]
                record["of_ideal_per_round"] = [
                    round(share_of_ideal(s, t, P, M), 4)
                    for s, t in zip(slowest[system][w:], slowest["single"][w:])
                ]
                if ref == "torch.pipelining" and system == ref:  # the reference's share of the ideal
                    ref_share = (statistics.median(record["of_ideal_per_round"]), baseline["samples_per_s"])
            elif ref is not None and ref_share is not None:  # through the reference: its share x ours over it
                record["single_samples_per_s"] = ref_share[1]
                record["of_ideal_per_round"] = [round(ref_share[0] * x, 4) for x in record["ref_ratios"]]
                record["of_ideal_via"] = "torch.pipelining 1f1b (reference) in the same rounds"
            results.append(record)
        if baseline is not None:
            single = {"system": "single", "schedule": None, "pipeline": 1, "microbatches": M, **baseline}
            results.append(single | {"first_loss": first["single"], "paired_with": name})
        if rank == 0:
            rates = ", ".join(
                f"{k} {spec['global_batch_size'] / statistics.median(v[w:]):.2f}" for k, v in slowest.items()
            )
            worker_log(f"P={P} {name}: {rates} samples/s")
    return results


# ------------------------------------------------------------------------------------------ driver


def main(argv: list[str]) -> None:
    run_worker(argv, run_rounds)


if __name__ == "__main__":
    main(sys.argv[1:])
