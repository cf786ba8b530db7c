"""`varuna bench telemetry`: what the workers' telemetry costs, and how fast the workbench redraws.

    python -m varuna.bench telemetry --json       # one JSON object on stdout
    python -m varuna.bench telemetry --quick      # tiny model, few steps: a smoke run of every path

Throughput, telemetry on against off, in one job: a GPT pipeline (`full`: `gpt_bench()`'s layers,
2 stages x 1 replica, 1F1B, 8 micro-batches, one torch thread per rank) started by a live
`JobController` in this process, so "on" is the real path: spans of every action, per-step metrics
and memory, each event appended to the run directory's log and PUSHed (signed) to the controller,
which verifies and stores it. "Off" is the same job with its telemetry paused (`Telemetry.paused`:
nothing recorded, logged or sent; commands still read), so both phases run in the same processes
on the same warm caches. The job switches every step on every rank at once: warm-up (on), then
pairs of adjacent steps (off, on), (on, off), (off, on), ... (see `varuna.bench.telemetry.worker`).

Cores shared with other work make single steps noisy, but the noise drifts over seconds, so each
"on" step is compared with the "off" step next to it, each step in one pair only (a slow step then
counts against whichever phase it fell in, equally often):

    x_k              log(t(on) / t(off)) of pair k                    (wall seconds)
    typical          median of x_k over the pairs whose on step did not count activations
    memory term      the activations count runs on 1 recorded step in VARUNA_TELEMETRY_MEMORY_EVERY
                     (20): m = (exp(median x of those pairs - typical) - 1) / 20
    overhead         1 - 1 / (exp(typical) * (1 + m))                (a fraction of throughput)
    spread           per repeat (the job cut into `repeats` stretches of consecutive pairs), a
                     bootstrap 90 % interval over pairs, and the same estimate from the CPU seconds

`samples_per_s_off` is the global batch over the median off step; `samples_per_s_on` is that times
(1 - overhead), so `overhead` is (off - on) / off. The naive figures (means of the on and off steps)
are under `estimate.naive`. Messages of an "on" step that the controller handles while the next step
runs may be charged to an "off" step after it; they are a few events a step, so that bias is small
against the overhead. Then the widget refresh rate for 4 stages x 64 micro-batches, from
`varuna_widgets.bench.measure_refresh_hz` (in a subprocess, after the job: it must not compete with
it for the cores; null, with a note, where the widgets package is missing).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from varuna.bench import ROOT, bench_env, log, print_report, require_positive
from varuna.errors import ConfigError, LaunchError
from varuna.schedule import SCHEDULES

__all__ = ["TelemetryBench", "full", "quick", "run", "analyse", "format_table", "main"]

_WORKER = "varuna.bench.telemetry.worker"
_TARGET = 0.02  # the target; reported, never asserted


@dataclass(kw_only=True, slots=True)
class TelemetryBench:
    """What the telemetry benchmark measures; see `full` and `quick` for the presets."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `varuna.models.GPTConfig`."""
    pipeline: int = 2
    """Pipeline stages P (one replica: the ranks fill the host's cores)."""
    global_batch_size: int = 8
    """Samples per optimizer step."""
    micro_batch_size: int = 1
    """Samples per micro-batch; M = global_batch_size / micro_batch_size."""
    schedule: str = "1f1b"
    """The engine's schedule."""
    warmup: int = 3
    """Steps before the measured ones, telemetry on (hello, the first memory count, warm caches)."""
    pairs: int = 90
    """Measured pairs of adjacent steps, (off, on) and (on, off) in turn."""
    repeats: int = 8
    """Stretches of consecutive pairs the spread is reported over."""
    memory_every: int | None = None
    """VARUNA_TELEMETRY_MEMORY_EVERY for the job; None keeps the telemetry's default (20)."""
    widget_stages: int = 4
    """Stages of the synthetic pipeline the widget refresh is measured on."""
    widget_microbatches: int = 64
    """Micro-batches per step of that pipeline."""
    widget_seconds: float = 3.0
    """Seconds the widget refresh is measured for."""
    job_timeout_s: float = 240.0
    """The job fails, naming its config, when it runs longer."""

    def __post_init__(self) -> None:
        require_positive(self, "pipeline", "global_batch_size", "micro_batch_size", "pairs", "repeats")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ConfigError(f"TelemetryBench.warmup must be an integer >= 0 (got {self.warmup!r})")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"TelemetryBench.schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.repeats > self.pairs:
            raise ConfigError(f"TelemetryBench.repeats ({self.repeats}) must be <= pairs ({self.pairs})")
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"TelemetryBench.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )

    @property
    def steps(self) -> int:
        return self.warmup + 2 * self.pairs


def full() -> TelemetryBench:
    """`gpt_bench()` (8 blocks, d_model 256, seq 128, vocab 4096) at 2x1, batch 8 in 8 micro-batches.

    Micro-batches of 1: as many spans per step as the batch-32 run of DESIGN.md in a quarter of
    its time, which makes the telemetry's share larger (the harder case) and gives more steps.
    """
    from varuna.models import gpt_bench

    return TelemetryBench(model=asdict(gpt_bench()))


def quick() -> TelemetryBench:
    """`gpt_tiny()` at 2x1, batch 8 in 4 micro-batches, 8 pairs, the memory count every 3 steps."""
    from varuna.models import gpt_tiny

    return TelemetryBench(
        model=asdict(gpt_tiny()),
        global_batch_size=8,
        micro_batch_size=2,
        warmup=1,
        pairs=8,
        repeats=2,
        memory_every=3,
        widget_seconds=1.0,
        job_timeout_s=120.0,
    )


# -------------------------------------------------------------------------------------- analysis


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0]] * 3 if values else []
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [q[0], statistics.median(values), q[2]]


def _overhead(typical: float, term: float) -> float:
    """The fraction of throughput lost: plain on steps take exp(typical) times an off step, and
    counting the activations adds `term` (of an on step's time) on average."""
    return 1.0 - 1.0 / (math.exp(typical) * (1.0 + term))


def _estimate(regular: list[float], memory: list[float], memory_every: int) -> tuple[float, float, float]:
    """(overhead, typical, memory term) from the log ratios of plain pairs and of counting ones."""
    typical = statistics.median(regular)
    term = math.expm1(statistics.median(memory) - typical) / memory_every if memory else 0.0
    return _overhead(typical, term), typical, term


def analyse(
    steps: list[dict[str, Any]],
    *,
    global_batch_size: int,
    memory_every: int,
    repeats: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """The overhead estimate of the module docstring from the job's per-step records.

    `steps[i]` has `phase` ("warmup", "off" or "on"), `wall_s`, `cpu_s` (one per rank) and
    `memory_counted`; after the warm-up, steps 2k and 2k+1 are pair k, one off and one on.
    """
    measured = [s for s in steps if s["phase"] != "warmup"]
    pairs = []
    for a, b in zip(measured[0::2], measured[1::2]):
        if {a["phase"], b["phase"]} == {"off", "on"}:
            pairs.append((a, b) if a["phase"] == "off" else (b, a))
    if not any(not on["memory_counted"] for _, on in pairs):
        raise ConfigError("the telemetry bench needs (off, on) pairs of steps: raise TelemetryBench.pairs")
    chunk = -(-len(pairs) // max(min(repeats, len(pairs)), 1))
    result: dict[str, Any] = {}
    for name in ("wall", "cpu"):

        def t(step: dict[str, Any], name: str = name) -> float:
            return float(step["wall_s"] if name == "wall" else sum(step["cpu_s"]))

        x = [math.log(t(on) / t(off)) for off, on in pairs]
        counted = [on["memory_counted"] for _, on in pairs]
        regular = [v for v, c in zip(x, counted) if not c]
        memory = [v for v, c in zip(x, counted) if c]
        overhead, typical, term = _estimate(regular, memory, memory_every)
        per_repeat = []
        for k in range(0, len(pairs), chunk):
            part = [v for v, c in zip(x[k : k + chunk], counted[k : k + chunk]) if not c]
            if part:
                per_repeat.append(_overhead(statistics.median(part), term))
        rng = random.Random(seed)
        boot = sorted(
            _overhead(statistics.median(rng.choices(regular, k=len(regular))), term) for _ in range(2000)
        )
        result[name] = {
            "overhead": overhead,
            "typical_step_extra": math.expm1(typical),
            "memory_term": term,
            "memory_count_pairs": len(memory),
            "step_extra_quartiles": [round(math.expm1(q), 5) for q in _quartiles(regular)],
            "per_repeat": [round(o, 5) for o in per_repeat],
            "per_repeat_range": [round(min(per_repeat), 5), round(max(per_repeat), 5)],
            "bootstrap_90": [round(boot[100], 5), round(boot[1899], 5)],
        }
    off_wall = [off["wall_s"] for off, _ in pairs]
    on_wall = [on["wall_s"] for _, on in pairs]
    t_off = statistics.median(off_wall)
    off = global_batch_size / t_off
    naive_off, naive_on = statistics.fmean(off_wall), statistics.fmean(on_wall)
    wall = result["wall"]
    return {
        "samples_per_s_off": off,
        "samples_per_s_on": off * (1.0 - wall["overhead"]),
        "overhead": wall["overhead"],
        "overhead_bootstrap_90": wall["bootstrap_90"],
        "cpu_overhead": result["cpu"]["overhead"],
        "median_step_s": {"off": t_off, "on": statistics.median(on_wall)},
        "wall": wall,
        "cpu": result["cpu"],
        "naive": {
            "samples_per_s_off": global_batch_size / naive_off,
            "samples_per_s_on": global_batch_size / naive_on,
            "overhead": 1.0 - naive_off / naive_on,
        },
        "measured_steps": {"off": len(off_wall), "on": len(on_wall)},
    }


# ------------------------------------------------------------------------------------------ runs


def _job(bench: TelemetryBench, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the on/off job under a live controller; its per-step records and what the controller got."""
    from varuna.controller import JobController

    out = tmp / "steps.json"
    spec = {
        "model": bench.model,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "schedule": bench.schedule,
        "warmup": bench.warmup,
        "pairs": bench.pairs,
        "out": str(out),
        "hang_s": bench.job_timeout_s,
    }
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    # The sampling settings of this environment (VARUNA_TELEMETRY_*) are measured as they are.
    env = {**bench_env(60), "VARUNA_TELEMETRY": "1"}
    if bench.memory_every is not None:
        env["VARUNA_TELEMETRY_MEMORY_EVERY"] = str(bench.memory_every)
    name = f"GPT {bench.pipeline}x1 {bench.schedule}, {bench.steps} steps"
    log(f"{name}: starting under a JobController")
    t0 = time.perf_counter()
    ctl = JobController.start(
        ["-m", _WORKER, str(spec_path)],
        pipeline=bench.pipeline,
        data=1,
        run_dir=tmp / "run",
        elastic=False,
        env=env,
        timeout_s=bench.job_timeout_s,
        grace_s=5.0,
    )
    try:
        live = 0
        deadline = time.monotonic() + bench.job_timeout_s + 30
        while ctl.exit_code is None and ctl.state not in ("stopped", "failed", "finished"):
            live = ctl.store.count  # what came over the socket while the job ran
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        state = ctl.wait(timeout=30)
        if state != "finished" or not out.exists():
            tail = "\n".join(list(ctl.console.lines)[-40:])
            raise LaunchError(
                f"benchmark job {name} ended {state} (exit code {ctl.exit_code}); summary: "
                f"{ctl.summary()}; rank logs in {tmp / 'run' / 'logs'}\n{tail}"
            )
        ranks = ctl.ranks()
        got = {
            "events_received_live": live,
            "events_total": ctl.store.count,
            "step_metrics_per_rank": [r.steps for r in ranks],
            "channel_dropped": ctl._channel.dropped if ctl._channel is not None else None,
        }
    finally:
        if ctl.state not in ("stopped", "failed", "finished"):
            ctl.stop(checkpoint=False, timeout=30)  # an error or ^C here must not leave the ranks running
        ctl.close()
    log(f"{name}: done in {time.perf_counter() - t0:.1f} s")
    return json.loads(out.read_text()), got


_WIDGET_CODE = (
    "import json, sys\n"
    "from varuna_widgets.bench import measure_refresh_hz\n"
    "s, m, t = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])\n"
    "print(json.dumps(measure_refresh_hz(stages=s, microbatches=m, seconds=t)))\n"
)


def widget_refresh(bench: TelemetryBench) -> dict[str, Any]:
    """`measure_refresh_hz(...)` in a fresh process; {"widget_refresh_hz": None, "widget_refresh_note": why}
    when the widgets package (or that function) is not importable, or fails."""
    args = [str(bench.widget_stages), str(bench.widget_microbatches), str(bench.widget_seconds)]
    log(f"widget refresh: {bench.widget_stages} stages x {bench.widget_microbatches} micro-batches")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _WIDGET_CODE, *args],
            env=bench_env(60),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=bench.widget_seconds * 10 + 60,
        )
    except subprocess.TimeoutExpired as exc:
        return {
            "widget_refresh_hz": None,
            "widget_refresh_note": f"measure_refresh_hz timed out ({exc.timeout:g} s)",
        }
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        missing = "ModuleNotFoundError" in last or "ImportError" in last
        why = "varuna_widgets.bench.measure_refresh_hz is not importable" if missing else "it failed"
        return {"widget_refresh_hz": None, "widget_refresh_note": f"{why}: {last}"}
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        hz = result["widget_refresh_hz"]
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        return {
            "widget_refresh_hz": None,
            "widget_refresh_note": f"unreadable result ({exc!r}): {proc.stdout[-300:]}",
        }
    return {"widget_refresh_hz": float(hz) if hz is not None else None, "widget": result}


def run(bench: TelemetryBench) -> dict[str, Any]:
    """Run the benchmark; the report as one JSON-able dict."""
    import torch

    from varuna.models import GPT, GPTConfig, count_parameters

    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="varuna-bench-telemetry-"))
    job, got = _job(bench, tmp)
    shutil.rmtree(tmp, ignore_errors=True)  # kept when the job fails: its logs are named in the error
    memory_every = job["memory_every"]
    estimate = analyse(
        job["steps"],
        global_batch_size=bench.global_batch_size,
        memory_every=memory_every,
        repeats=bench.repeats,
    )
    widget = widget_refresh(bench)
    cfg = GPTConfig(**bench.model)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report: dict[str, Any] = {
        **{k: estimate[k] for k in ("samples_per_s_off", "samples_per_s_on", "overhead")},
        "target_overhead": _TARGET,
        "target_met": estimate["overhead"] <= _TARGET,
        "target_met_by_upper_90": estimate["overhead_bootstrap_90"][1] <= _TARGET,
        **widget,
        "overhead_bootstrap_90": estimate["overhead_bootstrap_90"],
        "cpu_overhead": estimate["cpu_overhead"],
        "model": {
            "config": bench.model,
            "params": count_parameters(GPT(cfg)),
            "pipeline": bench.pipeline,
            "data": 1,
            "schedule": bench.schedule,
            "global_batch_size": bench.global_batch_size,
            "micro_batch_size": bench.micro_batch_size,
            "microbatches": job["num_microbatches"],
            "boundaries": job["boundaries"],
            "threads_per_rank": 1,
            "host_cores": os.cpu_count(),
            "torch_version": torch.__version__,
            "load_after": load,
        },
        "method": {
            "warmup": bench.warmup,
            "pairs": bench.pairs,
            "repeats": bench.repeats,
            "order": "warm-up steps on, then pairs of adjacent steps (off, on), (on, off), ...",
            "off": "Telemetry.paused in the same job (nothing recorded, logged or sent)",
            "on": "spans every step, metrics and memory, event log + signed ZeroMQ PUSH to a live JobController",
            "spans_every": job["spans_every"],
            "memory_every": memory_every,
            "min_interval_s": job["min_interval_s"],
        },
        "estimate": {k: estimate[k] for k in ("median_step_s", "wall", "cpu", "naive", "measured_steps")},
        "controller": {**got, "worker_drops": job["drops"]},
        "steps": job["steps"],
        "wall_s": 0.0,
    }
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def format_table(report: dict[str, Any]) -> str:
    """The headline figures and the per-cycle spread as aligned text."""
    m, w = report["model"], report["estimate"]["wall"]
    hz = report["widget_refresh_hz"]
    lines = [
        f"telemetry bench: GPT {m['params'] / 1e6:.1f}M params, {m['pipeline']}x{m['data']} {m['schedule']}, "
        f"batch {m['global_batch_size']} in {m['microbatches']} micro-batches, {m['host_cores']} cores",
        f"  samples/s off  {report['samples_per_s_off']:8.2f}",
        f"  samples/s on   {report['samples_per_s_on']:8.2f}",
        f"  overhead       {report['overhead'] * 100:+7.2f} %   (target <= 2 %; 90% interval "
        + " .. ".join(f"{b * 100:+.2f}" for b in report["overhead_bootstrap_90"])
        + " %)",
        f"    typical step {w['typical_step_extra'] * 100:+7.2f} %   memory count {w['memory_term'] * 100:+.2f} %",
        "    per repeat   " + " ".join(f"{o * 100:+.1f}" for o in w["per_repeat"]) + " %",
        f"  cpu overhead   {report['cpu_overhead'] * 100:+7.2f} %   naive (means) "
        f"{report['estimate']['naive']['overhead'] * 100:+.2f} %",
        f"  events at the controller: {report['controller']['events_total']} "
        f"({report['controller']['events_received_live']} while running), drops {report['controller']['worker_drops']}",
        "  widget refresh "
        + (f"{hz:8.2f} Hz" if hz is not None else f"  n/a ({report.get('widget_refresh_note')})"),
        f"  wall {report['wall_s']:.1f} s",
    ]
    return "\n".join(lines)


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench telemetry`; `args` has `json` and `quick`."""
    report = run(quick() if args.quick else full())
    return print_report(report, format_table(report), args.json)
