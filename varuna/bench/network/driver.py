"""`varuna bench network`: pipelining against data parallelism as the link between hosts slows down.

    python -m varuna.bench network --json           # one JSON object on stdout
    python -m varuna.bench network --quick          # tiny model, two rates: a smoke run

Varuna is for commodity clusters on ordinary Ethernet: a deep pipeline with few replicas sends
activations between neighbours instead of all-reducing every gradient over slow links. This bench
measures where that starts to pay. Four ranks run on two namespace hosts, h2 and h3, two ranks each
(`varuna.bench.netns`; mpiexec runs on h1, whose link is left unshaped: it carries only the
launcher's traffic). Both worker hosts' links are shaped with a token bucket (`tc tbf`, both
directions) to each rate in turn, so traffic between the hosts crosses two links of that rate, and
traffic inside a host none. At each rate every system trains the same GPT (same seed, weights,
batches, AdamW, fixed global batch, the same micro-batches):

    varuna 1x4         pure data parallelism, the all-reduce overlapped with the last backward
    varuna 2x2         replicas-across-hosts: each pipeline inside a host, the all-reduce crosses
    varuna 2x2         stages-across-hosts: each replica's two stages on different hosts, the
                       all-reduce stays inside a host, activations cross
    varuna 4x1         one pipeline, stages 0-1 on h2 and 2-3 on h3: one boundary crosses
    ddp 1x4            torch's DistributedDataParallel (gloo, bucketed, overlapped), gradients
                       accumulated under no_sync() over the same micro-batches
    torch.pipelining   4x1, its 1F1B, cut where Varuna's 4x1 engine cut the model

Rank r is stage r % P of replica r // P, and hydra fills a hostfile's slots in order: `h2:2 h3:2`
puts ranks 0-1 on h2 and 2-3 on h3 (one job runs every system but one there), `h2:1 h3:1` alternates
the hosts (a second job runs the stages-across-hosts 2x2). Each rank reports its host name and the
report checks both placements (`placements_verified`). A job keeps its processes for every rate,
so its engines are built once while the link is unshaped, and the two jobs live side by side: at
each rate the bench shapes the link and lets them measure one after the other
(`varuna.bench.network.rates`), so that the two 2x2 placements are measured seconds apart, not a
whole job apart (a shared host's speed drifts over minutes). Within a job the systems
alternate step by step. While one job measures, the other's ranks only poll a file. A step is
timed from a barrier to the end of the optimizer step, the slowest rank's; step_s is the median of
the timed steps after the warm-up, samples/s the global batch over it. Before the steps of each rate
rank 0 sends a probe to a rank on the other host and back (`link_mbit_seen`: the rate gloo gets, the
check that the shaping holds, and what "unshaped" is on this machine).

`crossover_mbit` is the highest shaped rate at which Varuna's best pipelined shape (2x2 either
placement, or 4x1) beats both Varuna 1x4 and DDP (null if it beats them at none); `crossover` says
more (which shape, and whether it already wins unshaped). Each point's `planner` stays null here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from varuna.bench import log, print_report, require_positive
from varuna.bench.common import run_job
from varuna.bench.network.plot import write_plot
from varuna.bench.network.rates import LinkSchedule
from varuna.bench.network.report import (
    crossover,
    expected_hosts,
    format_table,
    placement_of,
    system_key,
)
from varuna.bench.pipeline.driver import TORCH_SCHEDULES
from varuna.errors import ConfigError, LaunchError

if TYPE_CHECKING:
    from varuna.bench.netns import NetnsHosts

__all__ = ["NetworkBench", "Job", "JOBS", "full", "quick", "run", "main"]

_WORKER = "varuna.bench.network.worker"
WORKERS = ("h2", "h3")
"""The worker hosts, two ranks each; the bench shapes both of their links. h1 runs mpiexec."""
RANKS = 4
COLLECTIVE_TIMEOUT_S = 300.0
"""The jobs' collective timeout in seconds (the benches' jobs get 60 by default): at the slowest rate
one all-reduce of the whole model's gradients takes many seconds."""


@dataclass(frozen=True)
class Job:
    """One `varuna run` job of the bench: where its ranks go and which systems it measures."""

    slots: dict[str, int]
    """The hostfile: hydra fills the slots in order, cycling, until every rank has one."""
    varuna_shapes: tuple[tuple[int, int], ...]
    """Varuna's P x D to build in this job."""
    baselines: tuple[str, ...] = ()
    """"ddp" (1x4) and "torch.pipelining" (4x1, beside Varuna's 4x1, where it takes its cut)."""
    placement: str | None = None
    """What the 2x2 of this job is: "replicas-across-hosts" or "stages-across-hosts"."""


JOBS = {
    "blocks": Job(
        {"h2": 2, "h3": 2},
        ((1, 4), (2, 2), (4, 1)),
        ("ddp", "torch.pipelining"),
        "replicas-across-hosts",
    ),
    "alternate": Job({"h2": 1, "h3": 1}, ((2, 2),), (), "stages-across-hosts"),
}
"""The bench's two jobs: ranks 0-1 on h2 and 2-3 on h3, then the hosts alternating rank by rank."""


@dataclass(kw_only=True, slots=True)
class NetworkBench:
    """What the network benchmark measures; see `full` and `quick` for the presets."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `varuna.models.GPTConfig` (untied head: torch.pipelining has no shared weights)."""
    global_batch_size: int = 64
    """Samples per optimizer step, the same for every system and shape."""
    micro_batch_size: int = 4
    """Samples per micro-batch; a replica of P x D runs global_batch_size / (D x micro_batch_size)."""
    rates: tuple[float | None, ...] = (None, 1000.0, 200.0, 50.0)
    """Link rates in Mbit/s, in the order measured; None: unshaped."""
    schedule: str = "1f1b"
    """The pipelined shapes' schedule, Varuna's and torch.pipelining's alike."""
    partition: str = "fastest"
    """Varuna's partition of the pipelined shapes (torch.pipelining takes its 4x1 cut)."""
    warmup: int = 1
    """Untimed steps per system at each rate (the first after a rate change)."""
    steps: int = 3
    """Timed steps per system at each rate; step_s is their median."""
    jobs: tuple[str, ...] = tuple(JOBS)
    """Which of `JOBS` to run."""
    job_timeout_s: float = 600.0
    """A job that runs longer fails, naming it; the jobs live side by side, so this bounds the whole
    bench (every rate of every job)."""

    def __post_init__(self) -> None:
        require_positive(self, "global_batch_size", "micro_batch_size", "steps")
        if self.warmup < 0:
            raise ConfigError(f"NetworkBench.warmup must be >= 0 (got {self.warmup})")
        if self.global_batch_size % (RANKS * self.micro_batch_size):
            raise ConfigError(
                f"NetworkBench.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"{RANKS} x micro_batch_size ({self.micro_batch_size}): the 1x{RANKS} replicas split it"
            )
        if not self.rates or any(r is not None and r <= 0 for r in self.rates):
            raise ConfigError(f"NetworkBench.rates {self.rates} must be Mbit/s > 0 (None: unshaped)")
        if self.schedule not in TORCH_SCHEDULES:
            raise ConfigError(
                f"NetworkBench.schedule {self.schedule!r} is not one of {TORCH_SCHEDULES}: Varuna's pipelined "
                "shapes and torch.pipelining run the same schedule"
            )
        if self.partition not in ("balanced", "fastest", "uniform"):
            raise ConfigError(
                f"NetworkBench.partition {self.partition!r}: use 'balanced', 'fastest' or 'uniform'"
            )
        for name in self.jobs:
            if name not in JOBS:
                raise ConfigError(f"NetworkBench.jobs names {name!r}; the jobs are {tuple(JOBS)}")
        n_layer = self.model.get("n_layer", 4) * (2 if self.model.get("cut_inside_blocks") else 1)
        if n_layer < RANKS:
            raise ConfigError(f"the 4x1 shape needs at least 4 pieces to cut; the model has {n_layer}")


UNTIED = {"tie_embeddings": False, "cut_inside_blocks": True}


def full() -> NetworkBench:
    """A GPT of vocab 2048, seq 32, d_model 192, 8 blocks (4.35M parameters: 16.6 MiB of gradients
    against 24 KiB of activations per sample at a stage boundary), global batch 256 in micro-batches
    of 16; unshaped, then 2000, 1000, 500, 200, 50 and 20 Mbit/s."""
    model = {"vocab_size": 2048, "seq_len": 32, "d_model": 192, "n_layer": 8, "n_head": 6} | UNTIED
    return NetworkBench(
        model=model,
        global_batch_size=256,
        micro_batch_size=16,
        rates=(None, 2000.0, 1000.0, 500.0, 200.0, 50.0, 20.0),
        job_timeout_s=840.0,
    )


def quick() -> NetworkBench:
    """A tiny GPT (vocab 2048, seq 16, d_model 64, 2 blocks), batch 16 in micro-batches of 2;
    unshaped and 20 Mbit/s, 1 + 2 steps."""
    model = {"vocab_size": 2048, "seq_len": 16, "d_model": 64, "n_layer": 2, "n_head": 2} | UNTIED
    return NetworkBench(
        model=model,
        global_batch_size=16,
        micro_batch_size=2,
        rates=(None, 20.0),
        steps=2,
        job_timeout_s=150.0,
    )


# ---------------------------------------------------------------------------------------- jobs


def _systems(job: Job) -> list[dict[str, Any]]:
    """The job's systems in the order the worker builds them (Varuna's 4x1 before torch's)."""
    systems = [{"system": "varuna", "pipeline": P, "data": D} for P, D in job.varuna_shapes]
    if "ddp" in job.baselines:
        systems.append({"system": "ddp", "pipeline": 1, "data": RANKS})
    if "torch.pipelining" in job.baselines:
        systems.append({"system": "torch.pipelining", "pipeline": RANKS, "data": 1})
    return systems


@dataclass
class _Running:
    """A job of the bench while it runs: its folder, its command, and how its `run_job` ended."""

    name: str
    folder: Path
    cmd: list[str]
    title: str
    thread: threading.Thread | None = None
    error: BaseException | None = None

    @property
    def control(self) -> Path:
        return self.folder / "rates"


def _prepare(bench: NetworkBench, hosts: NetnsHosts, out: Path, name: str) -> _Running:
    """Write one job's spec and hostfile; its `varuna run` command, run on h1."""
    job = JOBS[name]
    folder = out / f"job-{name}"
    (folder / "rates").mkdir(parents=True, exist_ok=True)
    spec = {
        "model": bench.model,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "schedule": bench.schedule,
        "partition": bench.partition,
        "systems": _systems(job),
        "rates": len(bench.rates),
        "warmup": bench.warmup,
        "steps": bench.steps,
        "control": str(folder / "rates"),
        "rate_wait_s": bench.job_timeout_s,  # the other jobs' turns: the job's own timeout bounds it
        "out": str(folder / "result.json"),
        "hang_s": bench.job_timeout_s,
    }
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    hostfile = hosts.hostfile(folder / "hostfile", job.slots)
    env = [
        "env",
        f"VARUNA_MPIEXEC_ARGS={hosts.mpiexec_args}",
        f"VARUNA_TIMEOUT={COLLECTIVE_TIMEOUT_S:g}",
    ]
    cmd = [*env, sys.executable, "-m", "varuna", "run", "--hostfile", str(hostfile)]
    cmd += ["--pipeline", "1", "--data", str(RANKS), "--run-dir", str(folder / "run")]
    cmd += ["--timeout", f"{bench.job_timeout_s:g}", "-m", _WORKER, str(folder / "spec.json")]
    title = f"{name} ({', '.join(f'{h}:{n}' for h, n in job.slots.items())})"
    return _Running(name, folder, hosts.command("h1", cmd), title)


def _start(bench: NetworkBench, job: _Running) -> None:
    """Run the job to its end in a thread (`run_job`: its log, its timeout, its error)."""

    def target() -> None:
        try:
            run_job(job.title, job.cmd, bench.job_timeout_s + 30, job.folder / "job.log")
        except BaseException as exc:  # raised by `_run_jobs` in the main thread
            job.error = exc

    log(f"job {job.title}: starting")
    job.thread = threading.Thread(target=target, name=f"job-{job.name}", daemon=True)
    job.thread.start()


def _run_jobs(bench: NetworkBench, hosts: NetnsHosts, out: Path) -> dict[str, dict[str, Any]]:
    """Start the jobs one after another (each builds its systems while the others wait, so that no
    start-up profile is disturbed), then serve every rate to every job in turn; the workers' reports."""

    def shape(rate: float | None) -> None:
        for host in WORKERS:
            hosts.shape(host, rate)
        log(f"link of {' and '.join(WORKERS)} {'unshaped' if rate is None else f'at {rate:g} Mbit/s'}")

    jobs = [_prepare(bench, hosts, out, name) for name in bench.jobs]
    by_control = {job.control: job for job in jobs}

    def alive(control: Path) -> bool:
        thread = by_control[control].thread
        return thread is not None and thread.is_alive()

    link = LinkSchedule(bench.rates, shape)
    try:
        for job in jobs:
            _start(bench, job)
            link.ready(job.control, 0, alive)  # built, waiting for the first rate
        link.serve([job.control for job in jobs], alive)
        for job in jobs:
            if job.thread is not None:
                job.thread.join(bench.job_timeout_s + 60)
    except RuntimeError:  # a job ended early: its own error says why
        for job in jobs:
            if job.error is not None:
                raise job.error from None
        raise
    finally:  # whatever happened: the link as it was
        for host in WORKERS:
            hosts.shape(host, None)
    reports = {}
    for job in jobs:
        if job.error is not None:
            raise job.error
        result = job.folder / "result.json"
        if not result.exists():
            raise LaunchError(
                f"job {job.title} exited 0 but wrote no results ({result}); see {job.folder / 'job.log'}"
            )
        reports[job.name] = dict(json.loads(result.read_text()))
    return reports


# ---------------------------------------------------------------------------------------- report


def _assemble(bench: NetworkBench, jobs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report's points (one per rate, every system of every job), the placements' check and
    the losses' agreement."""
    points = []
    for i, rate in enumerate(bench.rates):
        results = []
        for name, report in jobs.items():
            job = JOBS[name]
            for system in _systems(job):
                measured = report["points"][i]["systems"][system_key(system)]
                P, D = system["pipeline"], system["data"]
                results.append(
                    {
                        "system": system["system"],
                        "shape": f"{P}x{D}",
                        "placement": job.placement if P > 1 and D > 1 else None,
                        "samples_per_s": round(bench.global_batch_size / measured["step_s"], 3),
                        "step_s": round(measured["step_s"], 5),
                        "timed_step_s": measured["timed_step_s"],
                        "warmup_step_s": measured["warmup_step_s"],
                        "rank_hosts": report["hosts"],
                    }
                )
        probed = {name: round(report["points"][i]["link_mbit"], 1) for name, report in jobs.items()}
        points.append({"rate_mbit": rate, "link_mbit_seen": probed, "results": results, "planner": None})
    placements = {}
    for name, report in jobs.items():
        job = JOBS[name]
        expected = expected_hosts(job.slots, RANKS)
        seen = placement_of(report["hosts"], 2, 2)
        placements[job.placement or name] = {
            "hostfile": job.slots,
            "rank_hosts": report["hosts"],
            "expected_rank_hosts": expected,
            "placement_at_2x2": seen,
            "verified": report["hosts"] == expected and seen == job.placement,
        }
    spread = 0.0
    for report in jobs.values():
        for point in report["points"]:
            for k in range(report["batches"]):
                losses = [s["losses"][k] for s in point["systems"].values()]
                spread = max(spread, max(losses) - min(losses))
    first = [s["losses"][0] for r in jobs.values() for s in r["points"][0]["systems"].values()]
    return {
        "points": points,
        "placements_verified": placements,
        "first_loss_spread": max(first) - min(first),
        "loss_spread": spread,
    }


def _model_info(bench: NetworkBench) -> dict[str, Any]:
    from varuna.models import GPT, GPTConfig, count_parameters

    params = count_parameters(GPT(GPTConfig(**bench.model)))
    cfg = bench.model
    boundary = bench.micro_batch_size * cfg["seq_len"] * cfg["d_model"] * 4
    return {
        "config": cfg,
        "params": params,
        "gradient_mib": round(params * 4 / 2**20, 2),
        "activation_kib_per_microbatch": round(boundary / 2**10, 1),
        "activation_mib_per_step_per_boundary": round(
            boundary * bench.global_batch_size / bench.micro_batch_size / 2**20, 2
        ),
        "dtype": "float32",
    }


def run(bench: NetworkBench, out: Path) -> dict[str, Any]:
    """Make the hosts, run each job over every rate, take the hosts down; the report."""
    import torch

    from varuna.bench.netns import NetnsHosts

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    hosts = NetnsHosts(3, workdir=out).up()
    try:
        jobs = _run_jobs(bench, hosts, out)
    finally:
        hosts.down()
    report: dict[str, Any] = {
        **_assemble(bench, jobs),
        "model": _model_info(bench),
        "global_batch": bench.global_batch_size,
        "micro_batch": bench.micro_batch_size,
        "schedule": bench.schedule,
        "optimizer": "AdamW",
        "warmup_steps": bench.warmup,
        "timed_steps": bench.steps,
        "hosts": {
            "workers": list(WORKERS),
            "ranks_per_host": RANKS // len(WORKERS),
            "launcher": "h1 (mpiexec; its link unshaped)",
            "shaped": list(WORKERS),
            "shaping": "tc tbf on both directions of each worker host's link; traffic between h2 and "
            "h3 crosses two links of the rate, traffic inside a host none",
            "host_cores": os.cpu_count() or 1,
            "threads_per_rank": 1,
        },
        "torch_version": torch.__version__,
    }
    report |= crossover(report["points"])
    report["plot"] = str(write_plot(report, out / "network.png"))
    report["out"] = str(out)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    return report


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench network`; `args` has `json`, `quick` and `out`."""
    from varuna.bench.netns import unavailable

    reason = unavailable()
    if reason is not None:
        print(f"varuna bench: network: cannot run here: {reason}", file=sys.stderr)
        return 2
    bench = quick() if args.quick else full()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if getattr(args, "out", None) else Path("runs") / f"bench-network-{stamp}"
    report = run(bench, out.resolve())
    return print_report(report, format_table(report), args.json)
