"""`varuna bench pipeline`: Varuna's schedules against torch.distributed.pipelining and one process.

    python -m varuna.bench pipeline --json          # ~7 min on 2 cores; one JSON object on stdout
    python -m varuna.bench pipeline --quick         # tiny model, a few steps: a smoke run

Every system trains the same GPT (same seed, same initial weights) on the same global batches,
with AdamW and one torch thread per rank:

    single             one process; each step runs forward+backward on every micro-batch and
                       accumulates gradients (same micro-batch size as the pipelines, so the same
                       kernels on the same shapes), then one optimizer step: the per-rank ideal.
    varuna             `Varuna(...)` with each schedule, at each P, D = 1, partition "balanced".
    torch.pipelining   `PipelineStage` + `ScheduleGPipe` / `Schedule1F1B` / `ScheduleInterleavedZeroBubble`
                       (with one stage per rank: ZB1P, the ZB-H1 of zb-h1) on per-stage modules cut
                       from the same GPT at the same boundaries Varuna chose (the bench GPT has a
                       CutPoint inside every block too, so a boundary may split a block between its
                       attention and its MLP; both systems then split it there). The last stage's
                       LM head is an untied copy of the token embedding (torch.pipelining has no
                       tied weights across stages); it does the same matmul, so throughput is the
                       same, but after step 0 its weights drift from Varuna's.

A step is timed from a barrier to the end of the optimizer step, on every rank; its time is the
slowest rank's. samples/s = global batch / median timed step. Processes are reused: one job per P
runs every system and schedule (one start-up per P); rank 0 writes the job's results as JSON into
a temporary folder that this module collects. In a job the two systems alternate step by step at
the same schedule: this host's speed drifts by tens of percent over minutes, and each pair's ratio
cancels that; `paired.varuna_over_torch_pipelining` gives the median pair ratio (torch step /
Varuna step: above 1, Varuna is faster) with a 90% bootstrap interval. At the smallest P (the
comparison the targets are about) the one-process baseline runs in the same rounds (on rank 0,
the other ranks waiting), so each pipeline's share of its ideal is measured against the host as
it was at that time (`paired.of_bubble_ideal`). Varuna's own schedule, which torch.pipelining
lacks, runs after the paired ones in the same job, unpaired.

After each schedule's timed steps every system runs one more, untimed, in which each rank measures
how far its resident memory rises above where the step began (`step_peak_bytes_per_stage`: the
activations, gradients and buffers the step needs at its peak, after freed memory went back to the
system; the same measure for both systems).

`ratios` compares like with like at each P: varuna / torch.pipelining for the same schedule, and
each pipeline's samples/s over its bubble-limited ideal M / (M + P - 1) * P * single. A P larger
than the host's cores cannot reach that ideal (ranks share cores); such P are listed under
`oversubscribed`. Varuna's own schedule recomputes forwards (activation memory for compute), so
its ideal is lower than GPipe's and 1F1B's by about one forward per micro-batch on non-last stages.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from varuna.bench import bench_env, log, print_report, require_positive
from varuna.errors import ConfigError, LaunchError

__all__ = ["PipelineBench", "full", "quick", "run", "compute_ratios", "format_table"]

_ROOT = Path(__file__).resolve().parents[2]
_WORKER = "varuna.bench._pipeline_worker"
VARUNA_SCHEDULES = ("gpipe", "1f1b", "varuna", "zb-h1", "interleaved-1f1b", "zb-v")
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
    warmup: int = 1
    """Untimed steps before the timed ones (per system and schedule; the first step is the slow one)."""
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

    @property
    def microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size


def full() -> PipelineBench:
    """`gpt_bench()` (8 blocks, d_model 256, seq 128, vocab 4096), batch 32 in 8 micro-batches, P = 2 and 4."""
    from varuna.models import gpt_bench

    # 6 schedules x 3 systems at P = 2 and 5 x 2 at P = 4 in 6.5-7.5 minutes on 2 cores (8 pairs and 3
    # steps at P = 4 took 463-505 s on a slow day: over the 8 minutes the issue allows)
    return PipelineBench(model=asdict(gpt_bench()), paired_steps=7, steps=2)


def quick() -> PipelineBench:
    """`gpt_tiny()` with CutPoints inside the blocks as in `full`, batch 12 in 6 micro-batches, P = 3
    only (first, middle and last stages), 1+2 steps."""
    from varuna.models import gpt_tiny

    return PipelineBench(
        model=asdict(gpt_tiny()) | {"cut_inside_blocks": True},
        global_batch_size=12,  # M = 6: interleaved-1f1b runs rounds of P micro-batches
        micro_batch_size=2,
        pipelines=(3,),
        steps=2,
        paired_steps=2,
        job_timeout_s=150.0,
    )


# ---------------------------------------------------------------------------------------- jobs


def _log(msg: str) -> None:
    log(msg)


def _env() -> dict[str, str]:
    return bench_env(60)


def _run_job(name: str, cmd: list[str], timeout_s: float, log: Path) -> None:
    """Run one job to completion, or raise LaunchError naming `name` with the end of its output."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, env=_env(), cwd=_ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # `varuna run` stops its ranks on SIGTERM; SIGKILL the session if it does not.
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = f"timeout after {timeout_s:g} s"
    text = log.read_text(errors="replace")
    if code != 0:
        tail = "\n".join(text.splitlines()[-40:])
        raise LaunchError(f"benchmark job {name} failed ({code}); its log: {log}; the end of it:\n{tail}")
    for line in text.splitlines():
        if "[bench]" in line:
            print(line, file=sys.stderr)
    _log(f"{name}: done in {time.perf_counter() - t0:.1f} s")


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
        "partition": "balanced",
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
    _log(f"{name}: starting")
    # The outer limit only backs up `varuna run --timeout` (and the worker's own hang dump).
    _run_job(name, cmd, bench.job_timeout_s + 30, tmp / f"{tag}.log")
    if not out.exists():
        raise LaunchError(
            f"benchmark job {name} exited 0 but wrote no results ({out}); see {tmp / (tag + '.log')}"
        )
    return list(json.loads(out.read_text()))


# -------------------------------------------------------------------------------------- report


def _ratios(results: list[dict[str, Any]], rate: str) -> dict[str, Any]:
    single = next(r for r in results if r["system"] == "single")[rate]
    by = {(r["system"], r["schedule"], r["pipeline"]): r for r in results}
    vs_torch: dict[str, dict[str, float]] = {}
    of_ideal: dict[str, dict[str, dict[str, float]]] = {}
    ideal: dict[str, float] = {}
    for r in results:
        if r["system"] == "single":
            continue
        P, M, key = r["pipeline"], r["microbatches"], f"P{r['pipeline']}"
        ideal[key] = M / (M + P - 1) * P * single
        base = r.get("single_" + rate, single)  # measured in the same rounds (paired), else the single job
        of_ideal.setdefault(r["system"], {}).setdefault(key, {})[r["schedule"]] = r[rate] / (
            M / (M + P - 1) * P * base
        )
        other = by.get(("torch.pipelining", r["schedule"], P))
        if r["system"] == "varuna" and other is not None:
            vs_torch.setdefault(key, {})[r["schedule"]] = r[rate] / other[rate]
    return {
        "varuna_over_torch_pipelining": vs_torch,
        "of_bubble_ideal": of_ideal,
        "bubble_ideal_samples_per_s": ideal,
    }


def paired_ratios(results: list[dict[str, Any]], resamples: int = 2000) -> dict[str, Any]:
    """From the paired job: per P and schedule, the median over rounds of torch.pipelining's step time
    over Varuna's (> 1: Varuna faster), and under "of_bubble_ideal" each pipeline's share of its
    bubble-limited ideal M / (M + P - 1) * P * single with the single step of the same round; each
    with a 90% bootstrap interval (rounds resampled, fixed seed)."""
    rng = random.Random(0)

    def summary(values: list[float]) -> dict[str, Any]:
        medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
        return {
            "median": round(statistics.median(values), 4),
            "ci90": [round(medians[int(0.05 * resamples)], 4), round(medians[int(0.95 * resamples) - 1], 4)],
            "pairs": len(values),
        }

    vs_torch: dict[str, dict[str, Any]] = {}
    of_ideal: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        key = f"P{r['pipeline']}"
        if r["system"] == "varuna" and r.get("pair_ratios"):
            vs_torch.setdefault(key, {})[r["schedule"]] = summary(r["pair_ratios"])
        if r.get("of_ideal_per_round"):
            of_ideal.setdefault(r["system"], {}).setdefault(key, {})[r["schedule"]] = summary(
                r["of_ideal_per_round"]
            )
    return {"varuna_over_torch_pipelining": vs_torch, "of_bubble_ideal": of_ideal}


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets at the smallest P (the paired job): Varuna's fastest schedule over
    torch.pipelining's 1F1B and over its fastest schedule (median samples/s of the same rounds), and
    the smallest paired ratio over the schedules both run (each should be >= 1)."""
    P = min(r["pipeline"] for r in results if r["system"] != "single")
    rate = {
        system: {
            r["schedule"]: r["samples_per_s"] for r in results if r["system"] == system and r["pipeline"] == P
        }
        for system in ("varuna", "torch.pipelining")
    }
    mine, theirs = rate["varuna"], rate["torch.pipelining"]
    if not mine or not theirs:
        return {}
    best, best_torch = max(mine, key=mine.__getitem__), max(theirs, key=theirs.__getitem__)
    paired = paired_ratios(results)["varuna_over_torch_pipelining"].get(f"P{P}", {})
    worst = min(paired, key=lambda s: paired[s]["median"]) if paired else None
    out: dict[str, Any] = {
        "pipeline": P,
        "varuna_best": best,
        "torch_best": best_torch,
        "varuna_best_over_torch_best": round(mine[best] / theirs[best_torch], 4),
        "worst_same_schedule": None if worst is None else {"schedule": worst, **paired[worst]},
    }
    if "1f1b" in theirs:
        out["varuna_best_over_torch_1f1b"] = round(mine[best] / theirs["1f1b"], 4)
    return out


def compute_ratios(results: list[dict[str, Any]], host_cores: int) -> dict[str, Any]:
    """varuna / torch.pipelining per (P, schedule), and every pipeline's share of its bubble-limited ideal.

    From the median steps (`samples_per_s`), and again under `from_best_step` from the fastest
    steps (`best_samples_per_s`), which a host busy with other work distorts less.
    """
    pipelines = sorted({r["pipeline"] for r in results if r["system"] != "single"})
    return {
        **_ratios(results, "samples_per_s"),
        "paired": paired_ratios(results),
        "targets": targets(results),
        "from_best_step": _ratios(results, "best_samples_per_s"),
        "oversubscribed": {f"P{P}": P > host_cores for P in pipelines},
    }


def format_table(report: dict[str, Any]) -> str:
    """The results and ratios as aligned text."""
    m = report["model"]
    lines = [
        f"GPT {m['config']['n_layer']} blocks, d_model {m['config']['d_model']}, seq {m['config']['seq_len']}, "
        f"{m['params'] / 1e6:.2f}M params; batch {m['global_batch_size']} = {m['microbatches']} x "
        f"{m['micro_batch_size']}; {m['threads_per_rank']} thread/rank on {m['host_cores']} cores "
        f"(load {m['load_before'][0]:.2f} before, {m['load_after'][0]:.2f} after)",
        "",
        f"{'system':<17} {'schedule':<16} {'P':>2} {'M':>2} {'samples/s':>10} {'best':>7} {'step s':>8} "
        f"{'of ideal':>9} {'cpu s/step per stage':>28} {'step peak MB per stage':>24}",
    ]
    ideal = report["ratios"]["of_bubble_ideal"]
    for r in report["results"]:
        share = ideal.get(r["system"], {}).get(f"P{r['pipeline']}", {}).get(r["schedule"])
        lines.append(
            f"{r['system']:<17} {r['schedule'] or '-':<16} {r['pipeline']:>2} {r['microbatches']:>2} "
            f"{r['samples_per_s']:>10.2f} {r['best_samples_per_s']:>7.2f} {r['median_step_s']:>8.3f} "
            f"{'' if share is None else f'{share:.2f}':>9} "
            f"{' '.join(f'{c:.3f}' for c in r['cpu_s_per_step_per_stage']):>28} "
            f"{' '.join('-' if b is None else f'{b / 2**20:.1f}' for b in r.get('step_peak_bytes_per_stage') or []):>24}"
        )
    lines.append("")
    best = report["ratios"]["from_best_step"]["varuna_over_torch_pipelining"]
    for key, per in report["ratios"]["varuna_over_torch_pipelining"].items():
        flag = " (oversubscribed)" if report["ratios"]["oversubscribed"].get(key) else ""
        pairs = ", ".join(f"{s} {v:.2f} (best steps {best[key][s]:.2f})" for s, v in per.items())
        lines.append(f"varuna / torch.pipelining at {key}{flag}: {pairs}")
    paired = report["ratios"]["paired"]
    for system, by_p in paired["of_bubble_ideal"].items():
        for p, shares in by_p.items():
            text = ", ".join(
                f"{s} {v['median']:.3f} ({v['ci90'][0]:.3f}-{v['ci90'][1]:.3f})" for s, v in shares.items()
            )
            lines.append(f"paired, {system} at {p} of its ideal (single in the same rounds): {text}")
    for key, per in paired["varuna_over_torch_pipelining"].items():
        pairs = ", ".join(
            f"{s} {v['median']:.3f} (90% interval {v['ci90'][0]:.3f}-{v['ci90'][1]:.3f}, {v['pairs']} pairs)"
            for s, v in per.items()
        )
        lines.append(f"paired, torch step / varuna step at {key}: {pairs}")
    goal = report["ratios"].get("targets") or {}
    if goal:
        worst = goal["worst_same_schedule"]
        lines.append(
            f"targets at P{goal['pipeline']}: varuna's best ({goal['varuna_best']}) / torch 1f1b "
            f"{goal.get('varuna_best_over_torch_1f1b', float('nan')):.3f} (>= 1.10), / torch's best "
            f"({goal['torch_best']}) {goal['varuna_best_over_torch_best']:.3f} (>= 1.0)"
            + (
                ""
                if worst is None
                else f"; worst same-schedule pair {worst['schedule']} {worst['median']:.3f}"
            )
        )
    lines.append(f"wall time {report['wall_s']:.0f} s")
    return "\n".join(lines)


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
            "torch_pipelining_head": "untied copy of the token embedding on the last stage",
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
