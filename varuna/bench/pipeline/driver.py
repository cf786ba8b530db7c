"""`varuna bench pipeline`: Varuna's schedules against torch.distributed.pipelining and one process.

    python -m varuna.bench pipeline --json          # one JSON object on stdout
    python -m varuna.bench pipeline --quick         # tiny model, a few steps: a smoke run

Every system trains the same GPT (same seed, same initial weights) on the same global batches,
with AdamW and one torch thread per rank:

    single             one process; each step runs forward+backward on every micro-batch and
                       accumulates gradients (same micro-batch size as the pipelines, so the same
                       kernels on the same shapes), then one optimizer step: the per-rank ideal.
    varuna             `Varuna(...)` with each schedule, at each P, D = 1, partition "fastest" (the
                       profiled costs balanced, then the cut fitted to the schedule by the simulator).
    torch.pipelining   `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleavedZeroBubble`
                       (with one stage per rank: ZB1P, the ZB-H1 of zb-h1) on per-stage modules cut
                       from the same GPT at the boundaries Varuna chose for that schedule (the bench
                       GPT has a CutPoint inside every block too, so a boundary may split a block
                       between its attention and its MLP; both systems then split it there).

The bench GPT has its own LM head, not tied to the token embedding: torch.pipelining cannot share a
weight between stages, so with a tied GPT its last stage would train another model (an untied copy)
while Varuna summed the two stages' gradients of one weight each step. Untied, every system trains
the same model with the same weights. (A tied config still runs: torch.pipelining then gets the
untied copy, and `model.torch_pipelining_head` says so.)

A step is timed from a barrier to the end of the optimizer step, on every rank; its time is the
slowest rank's. samples/s = global batch / median timed step. Processes are reused: one job per P
runs every system and schedule (one start-up per P); rank 0 writes the job's results as JSON into a
temporary folder that this module collects. In a job the two systems alternate step by step at the
same schedule: a shared host's speed drifts over minutes, and each pair's ratio cancels that;
`paired.varuna_over_torch_pipelining` gives the median pair ratio (torch step / Varuna step: above
1, Varuna is faster) with a 90% bootstrap interval. At the smallest P (the comparison the targets
are about) the one-process baseline runs in the same rounds (on rank 0, the other ranks waiting), so
each pipeline's share of its ideal is measured against the host as it was at that time
(`paired.of_bubble_ideal`). The schedules torch.pipelining lacks (eager-1F1B, Varuna's own) run in
the same job, unpaired.

After each schedule's timed steps every system runs one more, untimed, in which each rank measures
how far its resident memory rises above where the step began (`step_peak_bytes_per_stage`: the
activations, gradients and buffers the step needs at its peak, after freed memory went back to the
system; the same measure for both systems).

`ratios` compares like with like at each P: varuna / torch.pipelining for the same schedule, and
each pipeline's samples/s over its bubble-limited ideal M / (M + P - 1) * P * single. A P larger
than the host's cores cannot reach that ideal (ranks share cores); such P are listed under
`oversubscribed`. Varuna's own schedule recomputes forwards (activation memory for compute), so
its ideal is lower than GPipe's and 1F1B's by about one forward per micro-batch on non-last stages.

`ratios.ceilings` bounds each Varuna schedule by its own work: torch.pipelining's 1F1B step over
the busiest rank's main-thread CPU seconds per step (no order of that work, idle all removed, can
beat it at these boundaries) and over the ranks' mean (nor with perfectly balanced stages), and
that mean with the fill added (a later rank cannot start before the earlier ones forwarded the
first micro-batch: the most any order and balance of that work could reach); see
`varuna.bench.pipeline.report.compute_ceilings`. A schedule's measured ratio over torch's 1F1B
can approach its ceiling only as far as its fill, drain and waiting allow.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from varuna.bench import log, print_report, require_positive
from varuna.bench.common import run_job
from varuna.bench.pipeline.report import compute_ratios, format_table
from varuna.errors import ConfigError, LaunchError

__all__ = ["PipelineBench", "full", "quick", "run", "main"]

_WORKER = "varuna.bench.pipeline.worker"
VARUNA_SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "varuna", "zb-h1", "interleaved-1f1b", "zb-v")
TORCH_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zb-v")


@dataclass(kw_only=True, slots=True)
class PipelineBench:
    """What the pipeline benchmark measures; see `full` and `quick` for the presets."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `varuna.models.GPTConfig`."""
    global_batch_size: int = 32
    """Samples per optimizer step (D = 1: all of them go through the one pipeline)."""
    micro_batch_size: int = 4
    """Samples per micro-batch; M = global_batch_size / micro_batch_size."""
    pipelines: tuple[int, ...] = (2, 4)
    """Pipeline depths P to measure."""
    varuna_schedules: tuple[str, ...] = VARUNA_SCHEDULES
    """Varuna schedules, each run at every P."""
    torch_schedules: tuple[str, ...] = TORCH_SCHEDULES
    """torch.distributed.pipelining schedules, each run at every P."""
    warmup: int = 2
    """Untimed steps before the timed ones (per system and schedule): the first is the slow one; after
    the second Varuna's zb-h1 and zb-v refit their order to the costs it measured (`refit_after`)."""
    steps: int = 4
    """Timed steps per system and schedule at every P but the smallest; samples/s uses their median."""
    paired_steps: int = 10
    """Timed steps per system and schedule at the smallest P (the comparison the targets are about),
    where the one-process baseline joins the rounds; more steps there narrow the intervals of the
    pair ratios and of the shares of the ideal."""
    job_timeout_s: float = 420.0
    """A job (every system and schedule at one P) that runs longer fails, naming its P."""

    def __post_init__(self) -> None:
        require_positive(self, "global_batch_size", "micro_batch_size", "steps", "paired_steps")
        if self.warmup < 0:
            raise ConfigError(f"PipelineBench.warmup must be >= 0 (got {self.warmup})")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"PipelineBench.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if len(set(self.pipelines)) != len(self.pipelines):
            raise ConfigError(f"PipelineBench.pipelines {self.pipelines} names a P twice; give each P once")
        n_layer = self.model.get("n_layer", 4)
        for P in self.pipelines:
            if not 2 <= P <= n_layer:
                raise ConfigError(
                    f"PipelineBench.pipelines holds {P}; each P must be in [2, n_layer] = [2, {n_layer}]"
                )
        if not self.varuna_schedules:
            raise ConfigError(
                "PipelineBench.varuna_schedules is empty; name at least one of "
                f"{VARUNA_SCHEDULES} (the bench measures Varuna; torch.pipelining is its reference)"
            )
        for s in self.varuna_schedules:
            if s not in VARUNA_SCHEDULES:
                raise ConfigError(f"varuna schedule {s!r} is not one of {VARUNA_SCHEDULES}")
        for s in self.torch_schedules:
            if s not in TORCH_SCHEDULES:
                raise ConfigError(f"torch.pipelining schedule {s!r} is not one of {TORCH_SCHEDULES}")
            if s not in self.varuna_schedules:
                raise ConfigError(
                    f"torch.pipelining schedule {s!r} is not among varuna_schedules {self.varuna_schedules}: "
                    "torch.pipelining runs where Varuna's engine cut the model for the same schedule; add it there"
                )

    @property
    def microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


UNTIED = {"tie_embeddings": False}
"""The bench GPT's own LM head (see the module's docstring): the same model for every system."""


def full() -> PipelineBench:
    """`gpt_bench()` (8 blocks, d_model 256, seq 128, vocab 4096) with its own LM head, batch 32 in
    8 micro-batches, P = 2 and 4."""
    from varuna.models import gpt_bench

    # fewer timed steps than the defaults: the whole run stays within the 8 minutes the issue allows
    # on 2 cores (docs/benchmarks/pipeline.md has its run times)
    return PipelineBench(model=asdict(gpt_bench()) | UNTIED, paired_steps=7, steps=2)


def quick() -> PipelineBench:
    """`gpt_tiny()` with CutPoints inside the blocks as in `full`, batch 12 in 6 micro-batches, P = 3
    only (first, middle and last stages), 1+2 steps."""
    from varuna.models import gpt_tiny

    return PipelineBench(
        model=asdict(gpt_tiny()) | {"cut_inside_blocks": True} | UNTIED,
        global_batch_size=12,  # M = 6: interleaved-1f1b runs rounds of P micro-batches
        micro_batch_size=2,
        pipelines=(3,),
        steps=2,
        paired_steps=2,
        job_timeout_s=150.0,
    )


# ---------------------------------------------------------------------------------------- jobs


def _job(bench: PipelineBench, tmp: Path, pipeline: int, *, single: bool) -> list[dict[str, Any]]:
    """Every system and schedule of `bench` at one P, in one `varuna run` job (`run_rounds`)."""
    shared = [s for s in bench.varuna_schedules if s in bench.torch_schedules]
    name = f"P={pipeline} M={bench.microbatches} ({', '.join(shared) or 'none'} paired"
    name += f"{', with the one-process baseline' if single else ''})"
    tag = f"P{pipeline}"
    out = tmp / f"{tag}.json"
    spec = {
        "model": bench.model,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "pipeline": pipeline,
        "varuna_schedules": list(bench.varuna_schedules),
        "torch_schedules": list(bench.torch_schedules),
        "single": single,
        "reference": single and "1f1b" in bench.varuna_schedules and "1f1b" in bench.torch_schedules,
        "partition": "fastest",
        "warmup": bench.warmup,
        "steps": bench.paired_steps if single else bench.steps,
        "out": str(out),
        "run_dir": str(tmp / "varuna-run"),  # every job shares the segment profile
        "hang_s": bench.job_timeout_s,
    }
    spec_path = tmp / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "varuna", "run", "--pipeline", str(pipeline), "--data", "1"]
    cmd += ["--run-dir", str(tmp / f"job-{tag}"), "--timeout", f"{bench.job_timeout_s:g}"]
    cmd += ["-m", _WORKER, str(spec_path)]
    log(f"{name}: starting")
    # The outer limit only backs up `varuna run --timeout` (and the worker's own hang dump).
    run_job(name, cmd, bench.job_timeout_s + 30, tmp / f"{tag}.log")
    if not out.exists():
        raise LaunchError(
            f"benchmark job {name} exited 0 but wrote no results ({out}); see {tmp / (tag + '.log')}"
        )
    return list(json.loads(out.read_text()))


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(bench: PipelineBench) -> dict[str, Any]:
    """Run every job of `bench` (sequentially) and return the report."""
    import torch

    from varuna.models import GPT, GPTConfig, count_parameters

    t0 = time.perf_counter()
    load_before = _load()
    params = count_parameters(GPT(GPTConfig(**bench.model)))
    results: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="varuna-bench-"))
    for P in bench.pipelines:  # the baseline joins the rounds of the smallest P (the targets' one)
        results += _job(bench, tmp, P, single=P == min(bench.pipelines))
    shutil.rmtree(tmp, ignore_errors=True)  # kept when a job fails: its log is named in the error
    host_cores = os.cpu_count() or 1
    losses = [r["first_loss"] for r in results]
    report = {
        "model": {
            "config": bench.model,
            "params": params,
            "global_batch_size": bench.global_batch_size,
            "micro_batch_size": bench.micro_batch_size,
            "microbatches": bench.microbatches,
            "data_parallel": 1,
            "threads_per_rank": 1,
            "host_cores": host_cores,
            "warmup_steps": bench.warmup,
            "timed_steps": bench.steps,
            "paired_steps": bench.paired_steps,
            "optimizer": "AdamW",
            "single_mode": "micro-batched: forward+backward per micro-batch, gradients accumulated",
            "torch_pipelining_head": (
                "untied copy of the token embedding on the last stage"
                if bench.model.get("tie_embeddings", True)
                else "the GPT's own LM head (the same model as every system's)"
            ),
            "torch_version": torch.__version__,
            "load_before": load_before,
            "load_after": _load(),
            "first_loss_spread": max(losses) - min(losses),
        },
        "results": results,
        "ratios": compute_ratios(results, host_cores),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    return report


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench pipeline`; `args` has `json` and `quick`."""
    report = run(quick() if args.quick else full())
    return print_report(report, format_table(report), args.json)
