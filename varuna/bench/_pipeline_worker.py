"""One measured job of the pipeline benchmark: every rank runs this module, rank 0 writes the results.

    varuna run --pipeline P -m varuna.bench._pipeline_worker SPEC.json

SPEC.json (written by `varuna.bench.pipeline`) gives the model config, the batch shape, P, the
schedules of each system, whether the one-process baseline joins the rounds, the step counts and
the output file. The job runs every system at that P, schedule by schedule, alternating step by
step (`run_rounds`). Every system trains the same GPT (same seed, so the same initial weights) on
the same global batches with AdamW, one torch thread per rank. A step is timed from a barrier that
lines the ranks up to the end of the optimizer step; its time is the slowest rank's.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from varuna.data import SyntheticLM, collate, global_indices
from varuna.models import GPT, GPTConfig

LR = 1e-4
SEED = 0
DATA_SEED = 0


def share_of_ideal(step_s: float, single_step_s: float, pipeline: int, microbatches: int) -> float:
    """A pipeline's samples/s over its bubble-limited ideal M / (M + P - 1) * P * (one process's
    samples/s), from the two step times of the same global batch."""
    P, M = pipeline, microbatches
    return single_step_s / (step_s * P * M / (M + P - 1))


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _model(cfg: dict[str, Any]) -> GPT:
    torch.manual_seed(SEED)
    return GPT(GPTConfig(**cfg))


def _batches(spec: dict[str, Any]) -> list[dict[str, Tensor]]:
    """The global batches of steps 0 .. warmup+steps-1, made before any timing starts."""
    cfg, B = spec["model"], spec["global_batch_size"]
    steps = spec["warmup"] + spec["steps"]
    ds = SyntheticLM(cfg["vocab_size"], cfg["seq_len"], max(B * steps, 1024), seed=DATA_SEED)
    return [collate([ds[i] for i in global_indices(s, B, len(ds))]) for s in range(steps)]


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
            self.model = _model(spec["model"])
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


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class _VarunaRunner:
    """One Varuna engine of the spec's model at one schedule; `step(batch)` returns the loss."""

    def __init__(self, spec: dict[str, Any], schedule: str, example: dict[str, Tensor]) -> None:
        from varuna import Varuna

        self.engine = Varuna(
            _model(spec["model"]),
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


def _units(n_layer: int, inside: bool) -> list[tuple[str, int]]:
    """The GPT's blocks as the pieces a stage boundary can fall between, in order: each block whole,
    or (with `cut_inside_blocks`) its attention half and its MLP half."""
    if not inside:
        return [("block", i) for i in range(n_layer)]
    return [(half, i) for i in range(n_layer) for half in ("attend", "feed")]


def _chunks(schedule: str) -> int:
    from varuna.schedule import schedule_spec

    return schedule_spec(schedule).chunks_per_rank


def _partition(spec: dict[str, Any], schedule: str) -> Any:
    """The spec's partition: "fastest" (each schedule its own cut, fitted by the simulator to the
    profiled costs: `varuna.planner.cuts`), "balanced", or a list of boundaries (one-chunk
    schedules; the others then take "fastest")."""
    chosen = spec.get("partition", "fastest")
    return chosen if isinstance(chosen, str) or _chunks(schedule) == 1 else "fastest"


def _stage_units(boundaries: list[int], stage: int, units: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The units of `stage` under varuna's boundaries (cut c sits after unit c)."""
    first = boundaries[stage - 1] + 1 if stage > 0 else 0
    last = boundaries[stage] if stage < len(boundaries) else len(units) - 1
    return units[first : last + 1]


class _Stage(nn.Module):
    """One torch.pipelining stage cut from the GPT: the embedding on the first, then its units, and
    ln_f with the LM head on the last: the GPT's own head, or for a GPT that ties its head to the
    token embedding an untied copy of it (torch.pipelining has no weights shared across stages)."""

    def __init__(self, gpt: GPT, units: list[tuple[str, int]], *, first: bool, last: bool) -> None:
        super().__init__()
        self.units = units
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in sorted({i for _, i in units})})
        self.wte: nn.Embedding | None = gpt.wte if first else None
        self.wpe: nn.Embedding | None = gpt.wpe if first else None
        self.ln_f: nn.Module | None = None
        self.head: nn.Linear | None = None
        if last:
            self.ln_f = gpt.ln_f
            if gpt.lm_head is not None:
                self.head = gpt.lm_head
            else:
                self.head = nn.Linear(gpt.config.d_model, gpt.config.vocab_size, bias=False)
                with torch.no_grad():
                    self.head.weight.copy_(gpt.wte.weight)

    def forward(self, x: Tensor) -> Tensor:
        if self.wte is not None and self.wpe is not None:  # x is the input ids
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for kind, i in self.units:
            block = self.blocks[str(i)]
            x = block(x) if kind == "block" else getattr(block, kind)(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def _lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class _TorchRunner:
    """One torch.distributed.pipelining stage of the spec's model (at the spec's boundaries) and
    schedule, with its own AdamW; `step(batch)` returns the mean loss on the last stage."""

    def __init__(self, spec: dict[str, Any], name: str) -> None:
        import torch.distributed as dist
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleZBVZeroBubble,
        )

        from varuna.schedule import schedule_spec

        self.rank, P = dist.get_rank(), dist.get_world_size()
        if P != spec["pipeline"]:
            raise RuntimeError(
                f"torch.pipelining job has {P} ranks but the spec says pipeline={spec['pipeline']}"
            )
        # the virtual stages this rank holds, as Varuna places them (one per rank but for the
        # multi-chunk schedules: round-robin for interleaved-1f1b, a V for zb-v)
        sched = schedule_spec(name)
        n = P * sched.chunks_per_rank
        held = sched.stages_of(self.rank, P)
        self.first, self.last = 0 in held, n - 1 in held
        units = _units(spec["model"]["n_layer"], bool(spec["model"].get("cut_inside_blocks")))
        gpt = _model(spec["model"])
        bounds = spec["boundaries_by_schedule"][name]
        self.modules = [
            _Stage(gpt, _stage_units(bounds, v, units), first=v == 0, last=v == n - 1) for v in held
        ]
        del gpt
        stages: list[Any] = [PipelineStage(m, v, n, torch.device("cpu")) for m, v in zip(self.modules, held)]
        M = spec["global_batch_size"] // spec["micro_batch_size"]
        self.schedule: Any
        if name == "zb-h1":  # torch's ZB1P (ZB-H1) is its interleaved zero-bubble schedule on one stage
            self.schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=M, loss_fn=_lm_loss)
        elif name == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=_lm_loss)
        elif name == "zb-v":
            self.schedule = ScheduleZBVZeroBubble(stages, n_microbatches=M, loss_fn=_lm_loss)
        else:
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
            self.schedule = kind(stages[0], n_microbatches=M, loss_fn=_lm_loss)
        # two chunks of a block cut inside it share its module: each parameter once
        params = {id(p): p for m in self.modules for p in m.parameters()}
        self.opt = torch.optim.AdamW(list(params.values()), lr=LR)

    def step(self, batch: dict[str, Tensor]) -> float | None:
        mb_losses: list[Tensor] = []
        self.opt.zero_grad(set_to_none=True)
        args = (batch["input_ids"],) if self.first else ()
        if self.last:
            self.schedule.step(*args, target=batch["labels"], losses=mb_losses, return_outputs=False)
        else:
            self.schedule.step(*args)
        self.opt.step()
        return float(torch.stack(mb_losses).detach().mean()) if mb_losses else None


# -------------------------------------------------------------------------------------------- rounds


def _with_single(spec: dict[str, Any], schedule: str) -> bool:
    """Whether the one-process baseline joins the rounds of `schedule`: those of every schedule both
    systems run, or (when they share none) those of the first schedule only."""
    if not spec["single"]:
        return False
    shared = [s for s in spec["varuna_schedules"] if s in spec["torch_schedules"]]
    return schedule in shared if shared else schedule == spec["varuna_schedules"][0]


def run_rounds(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every system of every schedule at one P in this one job, step by step in turn.

    This host's speed drifts by tens of percent over minutes, so two jobs a minute apart compare
    the host as much as the systems. Here, for each schedule, step k of each system runs right
    after step k of the others (the order rotating), on the same processes, weights and batches:
    each round's ratio of torch.pipelining's step over Varuna's cancels the drift, and their median
    is the comparison (`pair_ratios`). With `spec["single"]` the baseline ("single": the whole model
    on rank 0, the other ranks waiting at the next barrier) runs in the same rounds, so a
    pipeline's share of its ideal compares it with the host as it was at the same time
    (`of_ideal_per_round`). One job per P also means one start-up per P, not one per system.

    Varuna's engine of each schedule chooses that schedule's boundaries (`spec["partition"]`,
    "fastest" by default: the segment profile is shared, the cut fitted to the schedule), and
    torch.pipelining's stages of the same schedule are cut at the same ones.
    """
    import torch.distributed as dist

    batches = _batches(spec)
    P, rank = spec["pipeline"], dist.get_rank()
    M = spec["global_batch_size"] // spec["micro_batch_size"]
    w = spec["warmup"]
    varuna_schedules, torch_schedules = spec["varuna_schedules"], spec["torch_schedules"]
    schedules = list(varuna_schedules) + [s for s in torch_schedules if s not in varuna_schedules]
    results: list[dict[str, Any]] = []
    for name in schedules:
        systems: dict[str, _VarunaRunner | _TorchRunner | _SingleRunner] = {}
        engine = None
        if name in varuna_schedules:
            runner = _VarunaRunner(spec, name, batches[0])
            engine = runner.engine
            # Varuna's engine cut the model for this schedule: torch.pipelining runs the same cut
            spec.setdefault("boundaries_by_schedule", {})[name] = list(engine.partition.boundaries)
            if rank == 0:
                _log(f"P={P} {name}: boundaries {list(engine.partition.boundaries)}")
            systems["varuna"] = runner
        if name in torch_schedules:
            systems["torch.pipelining"] = _TorchRunner(spec, name)
        if _with_single(spec, name):
            systems["single"] = _SingleRunner(spec, active=rank == 0)
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
        for system in names:  # one more step each, untimed: the memory it needs at its peak
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
        every = _gather({"systems": mine, "fractions": fractions, "peaks": peaks})
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
            if baseline is not None:
                record["single_samples_per_s"] = baseline["samples_per_s"]
                record["of_ideal_per_round"] = [
                    round(share_of_ideal(s, t, P, M), 4)
                    for s, t in zip(slowest[system][w:], slowest["single"][w:])
                ]
            results.append(record)
        if baseline is not None:
            single = {"system": "single", "schedule": None, "pipeline": 1, "microbatches": M, **baseline}
            results.append(single | {"first_loss": first["single"], "paired_with": name})
        if rank == 0:
            rates = ", ".join(
                f"{k} {spec['global_batch_size'] / statistics.median(v[w:]):.2f}" for k, v in slowest.items()
            )
            _log(f"P={P} {name}: {rates} samples/s")
    return results


# ------------------------------------------------------------------------------------------ driver


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(1)
    # A hang becomes a traceback of every thread and exit 1 (then mpiexec ends the job), before
    # the parent's own timeout has to kill anything.
    faulthandler.dump_traceback_later(spec["hang_s"], exit=True)
    results = run_rounds(spec)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out = Path(spec["out"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(out)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1:])
