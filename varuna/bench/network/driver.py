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
    torch.pipelining   4x1, its schedule, cut where Varuna's 4x1 engine cut the model
    torch.pipelining   2x2 stages-across-hosts (as Varuna's 2x2 beside it), its schedule per
                       replica, each stage's gradients all-reduced with the other replica's after
                       the schedule's step (`varuna.bench.pipeline.torch_baseline`)

Rank r is stage r % P of replica r // P, and hydra fills a hostfile's slots in order: `h2:2 h3:2`
puts ranks 0-1 on h2 and 2-3 on h3 (the "block" placement in the planner's terms: the first job
runs Varuna 1x4, 2x2, 4x1, DDP and torch.pipelining 4x1 there), `h2:1 h3:1` alternates the hosts
("cyclic": a second job runs the stages-across-hosts 2x2 of Varuna and torch.pipelining). Each rank
reports its host name and the report checks both placements (`placements_verified`).

The planner decides at every rate with the network it measures there (`varuna.bench.network.planner`):
before the jobs, one compute profile of the model (a job of 4 ranks on h2, `run_profile`, once the
host is quiet: `quiet_wait_s`); at each rate, before the systems' steps, the block job's ranks
profile the network between and within the hosts (`profile_network`, as `varuna profile` does
across hosts) and read how much ranks sharing the cores slow each other (`measure_slowdown`,
`sharing_rounds`; every rate is priced with the median of these readings over the run,
`_run_sharing`, not with the compute profile's reading). The
planner's pick (shape, placement) with its predicted step goes into each point beside the measured
results, with the micro-batch size and schedule fixed to the bench's; Varuna's engines run the
planner's cut (`partition="planner"`), so each measured Varuna shape is a configuration the planner
prices.
The host's speed drifts over minutes, so at each rate every job times the model's compute beside
its own steps (the worker's `compute_gauge`), and the profile's compute is scaled by that gauge over
the profile's own figure (`compute_factors`, one per job): the pick is made with the factor of the
job that profiled the network, and each measured configuration's prediction is priced with the
factor of the job that measured it.

A job keeps its processes for every rate, so its engines are built once while the link is
unshaped, and the two jobs live side by side: at each rate the bench shapes the link and lets them
measure one after the other (`varuna.bench.network.rates`), so that the two 2x2 placements are
measured seconds apart, not a whole job apart (a shared host's speed drifts over minutes). At the
fast rates each job takes five turns, in the order A B B A A B B A A B (`fast_turns`), its timed steps
split between them (two a turn), and only a rate's first turn starts with a warm-up round: a slow or
fast spell of the host, tens of seconds long, then falls on both jobs' systems, where with one turn
each (and with two) it fell on one job's and moved the pick between the two 2x2 placements. Within
a job the systems alternate step by step. While one job measures, the other's ranks only poll a
file. A step is timed from a barrier to the end of the optimizer step, the slowest rank's; step_s
is the median of the timed steps after the warm-up (`fast_steps` of them at the fast rates, where
steps are short and the host's noise weighs most, `steps` at the others), samples/s the global
batch over it. Before the steps of each rate rank 0 sends a probe to a rank on the other host and
back (`link_mbit_seen`: the rate gloo gets, the check that the shaping holds, and what "unshaped"
is on this machine).

`crossover_mbit` is the highest shaped rate at which Varuna's best pipelined shape (2x2 either
placement, or 4x1) beats both Varuna 1x4 and DDP (null if it beats them at none); `crossover` says
more (which shape, and whether it already wins unshaped). The report's `planner` sums up the
planner's picks against the issue's targets (pick within 5% of the best measured Varuna shape,
predicted step within 10% of the measured one).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from varuna.bench import fresh_out, log, print_report, require_positive, split_half_gap
from varuna.bench.common import forward_backward_s, run_job
from varuna.bench.load import foreign_cores_during, wait_quiet
from varuna.bench.network.planner import PLACEMENTS, judge_point, plan_point, planned_cuts, summarize
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
    from varuna.planner.costs import CostTable
    from varuna.planner.network import NetworkCost
    from varuna.planner.result import PlanResult

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
    baselines: tuple[tuple[str, int, int], ...] = ()
    """Other systems with their P and D: ("ddp", 1, 4), ("torch.pipelining", P, D) (cut where this
    job's Varuna engine of the same P cut the model)."""
    placement: str | None = None
    """What the 2x2 of this job is: "replicas-across-hosts" or "stages-across-hosts"."""
    ranks: Literal["block", "cyclic"] = "block"
    """How the hostfile puts ranks on hosts in the planner's terms (`Cluster.placement`): "block"
    (in rank order, two per host) or "cyclic" (dealt to the hosts in turn)."""
    profiles_network: bool = False
    """Whether this job's ranks profile the network at each rate for the planner (the profile
    needs ranks 0 and 1 on one host and the same number of ranks on every host)."""


JOBS = {
    "blocks": Job(
        {"h2": 2, "h3": 2},
        ((1, 4), (2, 2), (4, 1)),
        (("ddp", 1, 4), ("torch.pipelining", 4, 1)),
        "replicas-across-hosts",
        "block",
        profiles_network=True,
    ),
    "alternate": Job(
        {"h2": 1, "h3": 1}, ((2, 2),), (("torch.pipelining", 2, 2),), "stages-across-hosts", "cyclic"
    ),
}
"""The bench's two jobs: ranks 0-1 on h2 and 2-3 on h3, then the hosts alternating rank by rank."""
PROFILE_SLOTS = {"h2": RANKS}
"""Where the compute profile runs: every rank on one host, so that the profile sees them share
the machine's cores as they do in the jobs (the namespace hosts are one machine)."""


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
    partition: str = "planner"
    """Varuna's partition of the pipelined shapes: "planner" (the planner's cut from the bench's
    compute profile, `varuna.bench.network.planner.planned_cuts`), or the engine's "balanced",
    "fastest" or "uniform" (torch.pipelining takes the cut of Varuna's engine of the same P)."""
    profile_repeats: int = 3
    """Timed passes per micro-batch of the compute profile (`run_profile`'s `repeats`)."""
    warmup: int = 1
    """Untimed steps per system at each rate (the first after a rate change)."""
    steps: int = 3
    """Timed steps per system at each rate; step_s is their median."""
    fast_steps: int = 0
    """Timed steps per system at the fast rates (unshaped and at least `fast_from_mbit`), where a step
    takes a second or two and the host's noise moves a median of few steps most; 0: `steps` there too."""
    fast_from_mbit: float = 200.0
    """The slowest shaped rate that counts as fast for `fast_steps` and `fast_turns`, in Mbit/s."""
    fast_turns: int = 1
    """Turns each job takes at the fast rates (`varuna.bench.network.rates`): with 2 the jobs measure
    in the order A B and then B A (with 5: A B B A A B B A A B), the timed steps split between the
    turns, so that a slow spell of the shared host falls on every job's systems alike, not only on
    those of the job measuring then (the two 2x2 placements are in different jobs); 1: one turn each.
    The slow rates take one: there the shapes are far apart and a round takes tens of seconds."""
    turn_warmup: int = 0
    """Untimed rounds at the start of each of a rate's turns after the first (which has `warmup`):
    the link is shaped and the engines are warm by then (how a later turn's first step compared with
    the others: docs/benchmarks/network.md, five turns)."""
    sharing_rounds: int = 3
    """Rounds of `measure_slowdown` the network-profiling job runs at each rate, beside the network's
    profile: the planner prices every rate with the median of these readings over the run (the
    cores' sharing read beside the steps it predicts, `_run_sharing`), rather than with one reading
    at the run's start (docs/benchmarks/network.md has how they compared); 0: the compute
    profile's reading at every rate."""
    quiet_wait_s: float = 30.0
    """How long the driver waits, before the compute profile, for a moment in which other processes
    keep at most `max_foreign` cores busy (`varuna.bench.load.wait_quiet`): the profile's reading of
    ranks sharing cores (`compute_slowdown`) sets every prediction of the run; 0: no wait."""
    max_foreign: float = 0.15
    """Cores other processes may keep busy for the host to count as quiet (see `quiet_wait_s` and
    `profile_attempts`)."""
    profile_attempts: int = 3
    """How many times the compute profile may run: it runs again (after waiting for a quiet host)
    while other processes kept more than `max_foreign` cores busy during it, the host's busy CPU time
    (/proc/stat) less the profile job's own. Its readings (the cores' sharing, the runtime's cost per
    action) set every prediction of the run, and even a process at the lowest priority beside it
    moves them (docs/benchmarks/network.md)."""
    jobs: tuple[str, ...] = tuple(JOBS)
    """Which of `JOBS` to run."""
    job_timeout_s: float = 600.0
    """A job that runs longer fails, naming it; the jobs live side by side, so this bounds the whole
    bench (every rate of every job)."""

    def __post_init__(self) -> None:
        require_positive(self, "global_batch_size", "micro_batch_size", "steps", "profile_repeats")
        if self.warmup < 0 or self.turn_warmup < 0:
            raise ConfigError(
                f"NetworkBench.warmup and turn_warmup must be >= 0 (got {self.warmup}, {self.turn_warmup})"
            )
        if self.fast_steps < 0:
            raise ConfigError(
                f"NetworkBench.fast_steps must be >= 0 (got {self.fast_steps}; 0: `steps` at every rate)"
            )
        if self.fast_turns < 1 or any(self.steps_at(r) < self.turns_at(r) for r in self.rates):
            raise ConfigError(
                f"NetworkBench.fast_turns must be >= 1 and at most the timed steps of a fast rate, each turn "
                f"times at least one (got fast_turns {self.fast_turns}, fast_steps {self.fast_steps}, "
                f"steps {self.steps})"
            )
        require_positive(self, "profile_attempts")
        if self.sharing_rounds < 0:
            raise ConfigError(
                f"NetworkBench.sharing_rounds must be >= 0 (got {self.sharing_rounds}; 0: the compute "
                "profile's reading of shared cores at every rate)"
            )
        if self.quiet_wait_s < 0 or self.max_foreign < 0:
            raise ConfigError(
                f"NetworkBench.quiet_wait_s ({self.quiet_wait_s}) and max_foreign ({self.max_foreign}) "
                "must be >= 0 (quiet_wait_s 0: no wait for a quiet host)"
            )
        if not self.fast_from_mbit > 0:
            raise ConfigError(f"NetworkBench.fast_from_mbit must be Mbit/s > 0 (got {self.fast_from_mbit})")
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
        if self.partition not in PARTITIONS:
            raise ConfigError(
                f"NetworkBench.partition {self.partition!r}: use one of {', '.join(map(repr, PARTITIONS))}"
            )
        for name in self.jobs:
            if name not in JOBS:
                raise ConfigError(f"NetworkBench.jobs names {name!r}; the jobs are {tuple(JOBS)}")
        n_layer = self.model.get("n_layer", 4) * (2 if self.model.get("cut_inside_blocks") else 1)
        if n_layer < RANKS:
            raise ConfigError(f"the 4x1 shape needs at least 4 pieces to cut; the model has {n_layer}")

    def steps_at(self, rate: float | None) -> int:
        """Timed steps per system at `rate` Mbit/s (None: unshaped): `fast_steps` at the fast rates
        where given, else `steps`."""
        return self.fast_steps if self._fast(rate) and self.fast_steps else self.steps

    def turns_at(self, rate: float | None) -> int:
        """Turns each job takes at `rate` Mbit/s (None: unshaped): `fast_turns` at the fast rates, else 1."""
        return self.fast_turns if self._fast(rate) else 1

    def _fast(self, rate: float | None) -> bool:
        return rate is None or rate >= self.fast_from_mbit


PARTITIONS = ("planner", "balanced", "fastest", "uniform")
"""`NetworkBench.partition`'s choices."""
UNTIED = {"tie_embeddings": False, "cut_inside_blocks": True}


def full() -> NetworkBench:
    """A GPT of vocab 2048, seq 32, d_model 192, 8 blocks (4.35M parameters: 16.6 MiB of gradients
    against 24 KiB of activations per sample at a stage boundary), global batch 256 in micro-batches
    of 16; unshaped, then 2000, 1000, 500, 200, 50 and 20 Mbit/s; 10 timed steps per system from
    200 Mbit/s up (a slow spell of the shared host, a few rounds long, stays under the median), in
    five turns per job of two steps each (A B B A A B B A A B), 3 below."""
    model = {"vocab_size": 2048, "seq_len": 32, "d_model": 192, "n_layer": 8, "n_head": 6} | UNTIED
    return NetworkBench(
        model=model,
        global_batch_size=256,
        micro_batch_size=16,
        rates=(None, 2000.0, 1000.0, 500.0, 200.0, 50.0, 20.0),
        fast_steps=10,
        fast_turns=5,
        job_timeout_s=2400.0,
    )


def quick() -> NetworkBench:
    """A tiny GPT (vocab 2048, seq 16, d_model 64, 2 blocks), batch 16 in micro-batches of 2;
    unshaped and 20 Mbit/s: unshaped two turns, of 1 untimed + 2 timed rounds and of 1 timed round, at
    20 Mbit/s 1 + 2 in one turn; a profile of 2 timed passes after at most 2 s of waiting for a quiet
    host, one round of reading the shared cores per rate."""
    model = {"vocab_size": 2048, "seq_len": 16, "d_model": 64, "n_layer": 2, "n_head": 2} | UNTIED
    return NetworkBench(
        model=model,
        global_batch_size=16,
        micro_batch_size=2,
        rates=(None, 20.0),
        steps=2,
        fast_steps=3,
        fast_turns=2,
        profile_repeats=2,
        sharing_rounds=1,
        quiet_wait_s=2.0,
        job_timeout_s=150.0,
    )


# ---------------------------------------------------------------------------------------- jobs


def _systems(job: Job) -> list[dict[str, Any]]:
    """The job's systems in the order the worker builds them (Varuna's shapes before the others:
    torch.pipelining takes the cut of Varuna's engine of its P)."""
    systems = [{"system": "varuna", "pipeline": P, "data": D} for P, D in job.varuna_shapes]
    systems += [{"system": name, "pipeline": P, "data": D} for name, P, D in job.baselines]
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


def _command(
    bench: NetworkBench, hosts: NetnsHosts, folder: Path, slots: dict[str, int], spec: dict[str, Any]
) -> list[str]:
    """Write a job's spec and hostfile into `folder`; its `varuna run` command, run on h1."""
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))
    hostfile = hosts.hostfile(folder / "hostfile", slots)
    env = [
        "env",
        f"VARUNA_MPIEXEC_ARGS={hosts.mpiexec_args}",
        f"VARUNA_TIMEOUT={COLLECTIVE_TIMEOUT_S:g}",
    ]
    cmd = [*env, sys.executable, "-m", "varuna", "run", "--hostfile", str(hostfile)]
    cmd += ["--pipeline", "1", "--data", str(RANKS), "--run-dir", str(folder / "run")]
    cmd += ["--timeout", f"{bench.job_timeout_s:g}", "-m", _WORKER, str(folder / "spec.json")]
    return hosts.command("h1", cmd)


def _title(name: str, slots: dict[str, int]) -> str:
    return f"{name} ({', '.join(f'{h}:{n}' for h, n in slots.items())})"


def _prepare(
    bench: NetworkBench, hosts: NetnsHosts, out: Path, name: str, cuts: dict[int, list[int]]
) -> _Running:
    """One job's folder, spec, hostfile and command; `cuts`: the planner's cut per P, which
    Varuna's engines take with `partition="planner"`."""
    job = JOBS[name]
    folder = out / f"job-{name}"
    (folder / "rates").mkdir(parents=True, exist_ok=True)
    partition: str | dict[str, list[int]] = bench.partition
    if bench.partition == "planner":
        partition = {str(P): cut for P, cut in cuts.items()}
    spec = {
        "mode": "measure",
        "model": bench.model,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "schedule": bench.schedule,
        "partition": partition,
        "systems": _systems(job),
        "profile_network": job.profiles_network,
        "gauge_repeats": bench.profile_repeats,
        "sharing_rounds": bench.sharing_rounds,
        "rates": len(bench.rates),
        "warmup": bench.warmup,
        "turn_warmup": bench.turn_warmup,
        # the global batches of the longest rate: every turn's warm-up rounds and its timed ones
        "steps": max(bench.steps_at(r) + (bench.turns_at(r) - 1) * bench.turn_warmup for r in bench.rates),
        "steps_per_rate": [bench.steps_at(r) for r in bench.rates],
        "turns_per_rate": [bench.turns_at(r) for r in bench.rates],
        "control": str(folder / "rates"),
        "rate_wait_s": bench.job_timeout_s,  # the other jobs' turns: the job's own timeout bounds it
        "out": str(folder / "result.json"),
        "hang_s": bench.job_timeout_s,
    }
    cmd = _command(bench, hosts, folder, job.slots, spec)
    return _Running(name, folder, cmd, _title(name, job.slots))


def _profile(bench: NetworkBench, hosts: NetnsHosts, out: Path) -> tuple[CostTable, dict[str, Any]]:
    """The compute profile of the bench's model, once: a job of every rank on one host
    (`PROFILE_SLOTS`) runs `run_profile` at the bench's micro-batch size; the table and what to
    report of it."""
    from varuna.planner.costs import CostTable

    folder = out / "job-profile"
    folder.mkdir(parents=True, exist_ok=True)
    spec = {
        "mode": "profile",
        "model": bench.model,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "repeats": bench.profile_repeats,
        "warmup": 0,
        "steps": 1,
        "run_dir": str(folder),
        "out": str(folder / "result.json"),
        "hang_s": bench.job_timeout_s,
    }
    title = _title("profile", PROFILE_SLOTS)
    path = folder / "profile.json"
    cmd = _command(bench, hosts, folder, PROFILE_SLOTS, spec)
    for attempt in range(1, bench.profile_attempts + 1):
        t0 = time.perf_counter()
        load = wait_quiet(bench.max_foreign, bench.quiet_wait_s) if bench.quiet_wait_s > 0 else None
        waited = time.perf_counter() - t0
        log(f"job {title}: starting" + (f" (attempt {attempt})" if attempt > 1 else ""))
        path.unlink(missing_ok=True)  # an earlier attempt's
        t0 = time.perf_counter()
        during = foreign_cores_during(
            lambda: run_job(title, cmd, bench.job_timeout_s + 30, folder / "job.log")
        )
        wall = time.perf_counter() - t0
        if not path.exists():
            raise LaunchError(f"job {title} exited 0 but wrote no profile ({path}); see {folder / 'job.log'}")
        if during is None or during <= bench.max_foreign or attempt == bench.profile_attempts:
            break
        log(f"profile disturbed: other processes kept {during:.2f} cores busy while it ran; again")
    table = CostTable.load(path)
    info = {
        "path": str(path),
        "ranks_on": list(PROFILE_SLOTS),
        "micro_batch_size": bench.micro_batch_size,
        "repeats": bench.profile_repeats,
        "segments": table.num_segments,
        "microbatch_compute_s": round(forward_backward_s(table.segments, bench.micro_batch_size), 6),
        "compute_slowdown": {str(n): round(f, 3) for n, f in sorted(table.compute_slowdown.items())},
        "action_overhead_s": round(table.action_overhead_s, 6),
        "wall_s": round(wall, 1),
        "quiet_wait_s": round(waited, 1),
        "foreign_cores_before": None if load is None else round(load, 3),
        "foreign_cores_during": None if during is None else round(during, 3),
        "attempts": attempt,
    }
    return table, info


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


def _run_jobs(
    bench: NetworkBench, hosts: NetnsHosts, out: Path, cuts: dict[int, list[int]]
) -> dict[str, dict[str, Any]]:
    """Start the jobs one after another (each builds its systems while the others wait, so that no
    start-up profile is disturbed), then serve every rate to every job in turn; the workers' reports."""

    def shape(rate: float | None) -> None:
        for host in WORKERS:
            hosts.shape(host, rate)
        log(f"link of {' and '.join(WORKERS)} {'unshaped' if rate is None else f'at {rate:g} Mbit/s'}")

    jobs = [_prepare(bench, hosts, out, name, cuts) for name in bench.jobs]
    by_control = {job.control: job for job in jobs}

    def alive(control: Path) -> bool:
        thread = by_control[control].thread
        return thread is not None and thread.is_alive()

    link = LinkSchedule(bench.rates, shape, turns=[bench.turns_at(r) for r in bench.rates])
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


def _run_sharing(readings: list[dict[str, float]]) -> dict[str, float] | None:
    """The cores' sharing of a run: for each count of busy ranks, the median of the readings the
    network-profiling job took beside every rate's steps (None: it took none). Sharing is the
    machine's, not the link's: one reading is `sharing_rounds` short rounds, which a few seconds of
    a slow shared host can move far enough to misprice that rate's shapes of four busy ranks
    (docs/benchmarks/network.md, "The run's reading of shared cores"); the median over the rates
    keeps such a moment out."""
    if not readings:
        return None
    counts = sorted({n for r in readings for n in r}, key=int)
    return {n: statistics.median(r[n] for r in readings if n in r) for n in counts}


def _rate_sharing(reading: dict[str, float]) -> dict[int, float]:
    """The cores' sharing the network-profiling job read at a rate (`measure_slowdown` on its ranks,
    two per namespace host), raised to time-sharing's floor as on one host
    (`at_least_time_sharing`): the namespace hosts are one machine, whose cores every rank shares,
    which the ranks' host names do not tell `measure_slowdown`."""
    from varuna.comm.rendezvous import usable_cores
    from varuna.profile.slowdown import at_least_time_sharing

    table = {int(n): float(f) for n, f in reading.items()}
    return at_least_time_sharing(table, [("this machine", usable_cores())] * len(table))


def _ranking(bench: NetworkBench, table: CostTable, network: NetworkCost, factor: float | None) -> PlanResult:
    """The planner's ranking at a point, with the profile's compute scaled by `factor` (None: as
    profiled)."""
    from varuna.planner.hosts import scale_compute

    return plan_point(
        table if factor is None else scale_compute(table, factor),
        network,
        gpus=RANKS,
        global_batch_size=bench.global_batch_size,
        micro_batch_size=bench.micro_batch_size,
        schedule=bench.schedule,
    )


def _assemble(
    bench: NetworkBench,
    jobs: dict[str, dict[str, Any]],
    table: CostTable | None,
    profiled_compute_s: float | None = None,
) -> dict[str, Any]:
    """The report's points (one per rate, every system of every job, the planner's pick where a
    job profiled the network), the placements' check and the losses' agreement.

    Where a job's point timed the model's compute (`compute_s`) and the profile's own figure is
    given (`profiled_compute_s`), their ratio is that job's factor at the point (`compute_factors`):
    the host's speed drifts over a run by more than the target's 10%, and the jobs measure one after
    another. The planner ranks with the profile's compute scaled by the network-profiling job's
    factor (the pick and its `compute_factor`); each measured configuration's prediction is priced
    with the profile's compute scaled by the factor of the job that measured it (`judge_point`'s
    `by_job`). A job without a gauge is priced with the profile's compute as it is. Every point is
    priced with the cores' sharing of the run (`_run_sharing` of the network-profiling job's
    readings; each point keeps its own as `compute_slowdown_at_rate`), or the profile's where the
    job read none."""
    from varuna.planner.network import NetworkCost

    profiling = [n for n in jobs if JOBS[n].profiles_network]
    sharing = None
    if profiling:
        readings = [p["compute_slowdown"] for p in jobs[profiling[0]]["points"] if "compute_slowdown" in p]
        sharing = _run_sharing(readings)
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
                        "job": name,
                        "system": system["system"],
                        "shape": f"{P}x{D}",
                        "placement": job.placement if P > 1 and D > 1 else None,
                        "planner_placement": job.ranks,
                        "samples_per_s": round(bench.global_batch_size / measured["step_s"], 3),
                        "step_s": round(measured["step_s"], 5),
                        "timed_step_s": measured["timed_step_s"],
                        "split_half_gap": _rounded(split_half_gap(measured["timed_step_s"])),
                        "turn_step_s": measured.get("turn_step_s"),
                        "warmup_step_s": measured["warmup_step_s"],
                        "rank_hosts": report["hosts"],
                    }
                )
        probed = {name: round(report["points"][i]["link_mbit"], 1) for name, report in jobs.items()}
        point: dict[str, Any] = {"rate_mbit": rate, "link_mbit_seen": probed, "results": results}
        point |= {"planner": None, "planner_vs_best": None, "predicted_vs_measured": None}
        if table is not None and profiling:
            at = jobs[profiling[0]]["points"][i]
            network = NetworkCost.from_json(at["network"])
            point_table = table
            if sharing is not None:  # the cores' sharing as read beside the steps, the run's median
                point_table = replace(table, compute_slowdown=_rate_sharing(sharing))
            factors: dict[str, float | None] = {}
            for name, report in jobs.items():
                gauge = report["points"][i].get("compute_s")
                factors[name] = gauge / profiled_compute_s if gauge and profiled_compute_s else None
            # jobs with the same factor (None: no gauge) share one plan
            rankings = {f: _ranking(bench, point_table, network, f) for f in set(factors.values())}
            by_job = {name: rankings[factor] for name, factor in factors.items()}
            point |= judge_point(by_job[profiling[0]], results, network, by_job)
            point["planner"]["network"]["profile_s"] = round(at["network_profile_s"], 1)
            point["planner"]["compute_slowdown"] = {
                str(n): round(f, 3) for n, f in sorted(point_table.compute_slowdown.items())
            }
            point["planner"]["compute_slowdown_from"] = "rates' median" if sharing is not None else "profile"
            if "compute_slowdown" in at:
                point["planner"]["compute_slowdown_at_rate"] = {
                    n: round(f, 3)
                    for n, f in sorted(at["compute_slowdown"].items(), key=lambda kv: int(kv[0]))
                }
            factor = factors[profiling[0]]
            point["planner"]["compute_factor"] = None if factor is None else round(factor, 3)
            point["planner"]["compute_factors"] = {
                name: None if f is None else round(f, 3) for name, f in factors.items()
            }
        points.append(point)
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
        for point in report["points"]:  # the steps of each point (more at the fast rates)
            for k in range(min(len(s["losses"]) for s in point["systems"].values())):
                losses = [s["losses"][k] for s in point["systems"].values()]
                spread = max(spread, max(losses) - min(losses))
    first = [s["losses"][0] for r in jobs.values() for s in r["points"][0]["systems"].values()]
    return {
        "points": points,
        "placements_verified": placements,
        "first_loss_spread": max(first) - min(first),
        "loss_spread": spread,
    }


def _rounded(gap: float | None) -> float | None:
    return None if gap is None else round(gap, 4)


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
    fresh_out(out)
    hosts = NetnsHosts(3, workdir=out).up()
    try:
        table, profile = _profile(bench, hosts, out)
        cuts = planned_cuts(
            table,
            gpus=RANKS,
            global_batch_size=bench.global_batch_size,
            micro_batch_size=bench.micro_batch_size,
            schedule=bench.schedule,
        )
        jobs = _run_jobs(bench, hosts, out, cuts)
    finally:
        hosts.down()
    assembled = _assemble(bench, jobs, table, profile["microbatch_compute_s"])
    report: dict[str, Any] = {
        **assembled,
        "planner": summarize(assembled["points"])
        | {
            "profile": profile,
            "planned_cuts": {str(P): cut for P, cut in cuts.items()},
            "partition": bench.partition,
            "options": {
                "gpus": RANKS,
                "hosts": len(WORKERS),
                "micro_batch_size": bench.micro_batch_size,
                "schedule": bench.schedule,
                "recompute": False,
                "placements": list(PLACEMENTS),
                "shared_cores": True,
            },
        },
        "model": _model_info(bench),
        "global_batch": bench.global_batch_size,
        "micro_batch": bench.micro_batch_size,
        "schedule": bench.schedule,
        "optimizer": "AdamW",
        "warmup_steps": bench.warmup,
        "turn_warmup_steps": bench.turn_warmup,
        "turns_fast": bench.fast_turns,
        "timed_steps": bench.steps,
        "timed_steps_fast": bench.fast_steps or bench.steps,
        "fast_from_mbit": bench.fast_from_mbit,
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
