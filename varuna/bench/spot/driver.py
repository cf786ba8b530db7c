"""The spot bench's driver: one job per policy replays the same host-availability trace on namespace hosts.

    hosts   h1 (the agent and mpiexec, never taken) + one host per trace node (1 slot each: h2, h3, ...)
    ideal   for each rank count the trace has, a short `varuna run` on that many hosts in the shape the
            agent would choose measures samples/s; ideal = the time-weighted mean over the trace's
            intervals of the samples/s for the nodes present
    replay  per policy: the agent (`python -m varuna.elastic.agent RUN_DIR` on h1, its spec watching the
            hostfile) runs the job while the driver makes the trace's changes at their (scaled) times:
              add      the node's host joins the hostfile
              notice   `post_stop` with the deadline and the host (the elastic policy only: the baselines
                       have no notice handling)
              remove   the host leaves the hostfile and its ranks are SIGKILLed at once
            at the trace's end the job is asked to stop (checkpoint, exit) and the agent to stay stopped
    policies
      elastic       the agent follows the host set: shrinks at once, grows after the settle time,
                    checkpoints before a notice's deadline
      restart_only  after a failure it relaunches from the latest checkpoint on the hosts there and
                    never grows (TorchElastic's way)
      static        it runs only on every host it started with and waits for all of them after a failure

What a run reports, from the ranks' event logs (rank 0's `step_metrics`) and the agent's state:
samples trained before the trace's end in the final trajectory (each launch's steps from the step it
resumed at up to the step the next launch resumed at, the last launch's all), goodput = those samples
over the replay's wall time, the ideal, morphs (grow and shrink, from the agent), seconds per morph
(last step of one launch to the first of the next), steps redone (trained more than once), steps lost
and trained twice in the final trajectory, and the largest relative difference of its losses from
plain training of the same steps in one process.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from varuna._files import write_json_atomic
from varuna.bench import bench_env, fresh_out, log, print_report, require_positive
from varuna.bench.common import run_job
from varuna.bench.netns import NetnsHosts, unavailable
from varuna.bench.spot.trace import DEFAULT_TRACE, QUICK_TRACE, Trace, read_trace
from varuna.elastic.agent import AGENT_DIR, SPEC, read_state, write_intent
from varuna.elastic.hostset import edit_hostfile
from varuna.elastic.protocol import Shape
from varuna.elastic.reshape import choose_shape
from varuna.errors import ConfigError, LaunchError
from varuna.launch.notices import post_stop
from varuna.telemetry.events import read_events

__all__ = ["SpotBench", "POLICIES", "full", "quick", "run", "main", "analyse"]

POLICIES = ("elastic", "restart_only", "static")
_WORKER = "varuna.bench.spot.worker"


@dataclass(frozen=True)
class SpotBench:
    """The settings of one run."""

    duration_s: float = 300.0
    """The trace is stretched to this many seconds of replay."""
    nodes: int = 4
    """Trace nodes replayed (the first ones it names), one host of 1 slot each."""
    settle_s: float = 3.0
    pipeline: int = 2
    """The depth the job starts at (and the agent keeps near when it reshapes: no profile, the rule)."""
    global_batch_size: int = 16
    micro_batch_size: int = 2
    checkpoint_every: int = 5
    device_s_per_sample: float = 0.05
    """The stand-in for the accelerator's time per sample (see the worker)."""
    measure_steps: int = 12
    model: dict[str, Any] = field(
        default_factory=lambda: {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layer": 4, "n_head": 2}
    )
    lr: float = 0.01
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    side_by_side: bool = False
    """Replay the policies at once, each on worker hosts of its own, instead of one after the other:
    the quick run's smoke test of every path. Each replay's trace then starts at its job's first
    step, not at its launch: launches at once on shared cores can take past the quick trace's first
    removal (docs/benchmarks/spot.md). The replays share the cores (their jobs' steps are mostly the
    stand-in's sleep, their launches are not), so their goodputs are not those of replays run alone,
    nor counted from the launch; the ideal is measured alone either way."""

    def check(self) -> None:
        require_positive(
            self, "nodes", "pipeline", "global_batch_size", "micro_batch_size", "checkpoint_every"
        )
        copies = len(self.policies) if self.side_by_side else 1
        if 1 + self.nodes * copies > 9:
            raise ConfigError(
                f"SpotBench.nodes x {copies} replay{'s' * (copies > 1)} at once must be 1..8 (one namespace "
                f"host each, beside the agents' host), got nodes {self.nodes}"
            )
        if not self.duration_s > 0:
            raise ConfigError(f"SpotBench.duration_s must be > 0, got {self.duration_s}")


def full() -> SpotBench:
    return SpotBench()


def quick() -> SpotBench:
    """Two nodes over 28 s (QUICK_TRACE unless a trace is given), 4 measured steps, a 2 s settle, the
    three policies' replays side by side (`SpotBench.side_by_side`)."""
    return SpotBench(duration_s=28.0, nodes=2, measure_steps=4, settle_s=2.0, side_by_side=True)


# ---------------------------------------------------------------------------------- the jobs


def _worker_spec(bench: SpotBench, folder: Path, steps: int) -> Path:
    spec = {
        "model": bench.model,
        "seed": bench.seed,
        "lr": bench.lr,
        "dataset_size": 4096,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "checkpoint_every": bench.checkpoint_every,
        "device_s_per_sample": bench.device_s_per_sample,
        "steps": steps,
        "hang_s": 3600,
    }
    return write_json_atomic(folder / "spec.json", spec)


def shape_for(bench: SpotBench, ranks: int) -> Shape:
    """The shape the agent chooses for `ranks` devices before any profile exists (the rule)."""
    info = {
        "pipeline": bench.pipeline,
        "data": 1,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "num_segments": bench.model["n_layer"],
    }
    return choose_shape(ranks, info)


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    """Rank 0's step_metrics events of every launch, by time."""
    return [e for e in read_events(run_dir) if e["type"] == "step_metrics" and e.get("rank") == 0]


def measure(bench: SpotBench, hosts: NetnsHosts, workers: list[str], ranks: int, out: Path) -> float:
    """Samples/s of a job on the first `ranks` worker hosts in the agent's shape for them."""
    folder = out / f"measure-{ranks}"
    folder.mkdir(parents=True, exist_ok=True)
    shape = shape_for(bench, ranks)
    hostfile = hosts.hostfile(folder / "hosts", {h: 1 for h in workers[:ranks]})
    spec = _worker_spec(bench, folder, 3 + bench.measure_steps)
    cmd = [f"VARUNA_MPIEXEC_ARGS={hosts.mpiexec_args}", sys.executable, "-m", "varuna", "run"]
    cmd += ["--hostfile", str(hostfile), "-p", str(shape.pipeline), "-d", str(shape.data)]
    cmd += ["--run-dir", str(folder / "run"), "--timeout", "300", "-m", _WORKER, str(spec)]
    run_job(
        f"measure {ranks} ranks ({shape.pipeline}x{shape.data})",
        hosts.command("h1", ["env", *cmd]),
        330,
        folder / "log",
    )
    times = [e["time"] for e in _steps(folder / "run")][3:]
    periods = [b - a for a, b in zip(times, times[1:], strict=False)]
    if not periods:
        raise LaunchError(f"measure {ranks} ranks: too few steps logged in {folder / 'run'}")
    return bench.global_batch_size / statistics.median(periods)


def _kill_ranks(hosts: NetnsHosts, host: str) -> int:
    """SIGKILL every varuna rank on `host` (its machine taken); how many."""
    pids = subprocess.run(["ip", "netns", "pids", hosts.netns(host)], capture_output=True, text=True).stdout
    killed = 0
    for pid in pids.split():
        try:
            if b"varuna.launch.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), 9)
                killed += 1
        except (OSError, ValueError):
            continue
    return killed


def _current_job(run_dir: Path) -> str | None:
    launches = (read_state(run_dir) or {}).get("launches") or []
    return str(launches[-1]["job_id"]) if launches else None


def replay(
    bench: SpotBench,
    hosts: NetnsHosts,
    trace: Trace,
    mapping: dict[str, str],
    policy: str,
    out: Path,
    stop: threading.Event,
) -> dict[str, Any]:
    """Run the job under `policy` while replaying `trace`; what `analyse` makes of it. Once `stop` is
    set (the run is ending, e.g. another replay side by side failed) its waits end with a LaunchError."""

    def sleep(seconds: float) -> None:
        if stop.wait(max(0.0, seconds)):
            raise LaunchError(f"spot bench {policy}: stopped while replaying")

    folder = out / policy
    run_dir = folder / "run"
    (run_dir / AGENT_DIR).mkdir(parents=True, exist_ok=True)
    present = sorted(trace.availability()[0][2], key=list(mapping).index)
    hostfile = hosts.hostfile(folder / "hosts", {mapping[n]: 1 for n in present})
    shape = shape_for(bench, len(present))
    spec = {
        "argv": ["-m", _WORKER, str(_worker_spec(bench, folder, 10**6))],
        "pipeline": shape.pipeline,
        "data": shape.data,
        "hostfile": str(hostfile),
        "watch_hosts": "hostfile",
        "settle_s": bench.settle_s,
        "policy": policy,
        "elastic": True,
        "max_restarts": 1000,
        "grace_s": 3.0,
        "timeout_s": None,
        "env": {},
    }
    write_json_atomic(run_dir / AGENT_DIR / SPEC, spec)
    env = {**bench_env(60), "VARUNA_MPIEXEC_ARGS": hosts.mpiexec_args}
    agent_cmd = hosts.command("h1", [sys.executable, "-m", "varuna.elastic.agent", str(run_dir)])
    changes: list[dict[str, Any]] = []
    with open(folder / "agent.log", "wb") as agent_log:
        agent = subprocess.Popen(
            agent_cmd, env=env, stdin=subprocess.DEVNULL, stdout=agent_log, stderr=subprocess.STDOUT
        )
        start = time.time()
        try:
            if bench.side_by_side:  # the trace starts once the job trains (see SpotBench.side_by_side)
                start = _first_step(run_dir, agent, policy)
            for event in trace.removals(notices=policy == "elastic"):
                sleep(start + event.at_s - time.time())
                if agent.poll() is not None:
                    raise LaunchError(f"spot bench {policy}: the agent ended early ({folder / 'agent.log'})")
                host = mapping[event.node]
                if event.kind == "add":
                    edit_hostfile(hostfile, add={host: 1})
                elif event.kind == "notice":
                    deadline = time.time() + event.lead_s
                    post_stop(
                        run_dir,
                        reason="spot notice",
                        job=_current_job(run_dir),
                        deadline=deadline,
                        hosts=[host],
                    )
                else:
                    edit_hostfile(hostfile, remove=[host])
                    _kill_ranks(hosts, host)
                changes.append({"at_s": round(time.time() - start, 2), "event": event.kind, "host": host})
            sleep(start + trace.end_s - time.time())
            end = time.time()
            write_intent(run_dir, "stop")
            post_stop(run_dir, reason="end of the trace", job=_current_job(run_dir))
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                write_intent(run_dir, "kill")
                agent.wait(timeout=30)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    result = analyse(run_dir, start, end, bench.global_batch_size)
    result["changes"] = changes
    result["hosts"] = sorted(mapping.values())
    log(
        f"{policy}: {result['samples']} samples in {end - start:.0f} s, goodput {result['goodput']:.2f} samples/s, "
        f"{result['launches']} launches"
    )
    return result


def analyse(run_dir: Path, start: float, end: float, global_batch: int) -> dict[str, Any]:
    """What a replay did, from rank 0's step events (up to `end`) and the agent's state."""
    events = [e for e in _steps(run_dir) if e["time"] <= end]
    jobs = list(dict.fromkeys(str(e.get("job")) for e in events))
    by_job = {j: [e for e in events if str(e.get("job")) == j] for j in jobs}
    first = {j: min(e["step"] for e in by_job[j]) for j in jobs}
    trajectory: list[dict[str, Any]] = []
    for k, job in enumerate(jobs):
        until = first[jobs[k + 1]] if k + 1 < len(jobs) else None
        trajectory += [e for e in by_job[job] if until is None or e["step"] < until]
    steps = [e["step"] for e in trajectory]
    top = max(steps, default=-1)
    gaps = [by_job[b][0]["time"] - by_job[a][-1]["time"] for a, b in zip(jobs, jobs[1:], strict=False)]
    hosts = (read_state(run_dir) or {}).get("hosts") or {}
    samples = len(set(steps)) * global_batch
    return {
        "samples": samples,
        "seconds": round(end - start, 2),
        "goodput": samples / (end - start),
        "launches": len(jobs),
        "morphs": hosts.get("morphs") or {"grow": 0, "shrink": 0},
        "morph_s": round(statistics.mean(gaps), 2) if gaps else None,
        "steps_redone": len(events) - len({e["step"] for e in events}),
        "steps_lost": len(set(range(top + 1)) - set(steps)),
        "steps_trained_twice": len(steps) - len(set(steps)),
        "losses": [[e["step"], e["loss"]] for e in trajectory],
    }


def _first_step(
    run_dir: Path, agent: subprocess.Popen[bytes], policy: str, timeout_s: float = 120.0
) -> float:
    """When the job of `run_dir` logged its first step (wall time); a LaunchError if its agent ends
    first or none comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = _steps(run_dir)
        if steps:
            return float(steps[0]["time"])
        if agent.poll() is not None:
            break
        time.sleep(0.2)
    raise LaunchError(f"spot bench {policy}: the job logged no step (agent log beside {run_dir})")


def plain_losses(bench: SpotBench, steps: int) -> list[float]:
    """Plain training of the same model, batches and optimizer in this process."""
    import torch

    from varuna.data import SyntheticLM, collate, global_indices
    from varuna.models import GPT, GPTConfig

    torch.set_num_threads(1)
    torch.manual_seed(bench.seed)
    cfg = GPTConfig(**bench.model)
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 4096, seed=bench.seed)
    model = GPT(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=bench.lr)
    losses = []
    for k in range(steps):
        batch = collate([data[i] for i in global_indices(k, bench.global_batch_size, len(data))])
        loss = model(**batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


# ---------------------------------------------------------------------------------- the run


def run(bench: SpotBench, trace: Trace, out: Path) -> dict[str, Any]:
    bench.check()
    reason = unavailable()
    if reason is not None:
        raise ConfigError(f"the spot bench needs namespace hosts: {reason}")
    trace = trace.scaled(bench.duration_s, bench.nodes)
    nodes = trace.nodes
    t0 = time.perf_counter()
    fresh_out(out)
    copies = len(bench.policies) if bench.side_by_side else 1
    hosts = NetnsHosts(1 + len(nodes) * copies, workdir=out).up()
    workers = hosts.names[1:]
    # each replay's trace nodes -> worker hosts (side by side: hosts of its own)
    mappings = [dict(zip(nodes, workers[k * len(nodes) :], strict=False)) for k in range(copies)]
    mapping = mappings[0]
    spans = trace.availability()
    pool = ThreadPoolExecutor(len(bench.policies)) if bench.side_by_side else None
    stop = threading.Event()
    try:
        counts = sorted({len(p) for _, _, p in spans if p})
        throughput = {n: measure(bench, hosts, workers, n, out) for n in counts}
        log("samples/s by ranks: " + ", ".join(f"{n}: {v:.2f}" for n, v in throughput.items()))
        if pool is not None:
            log(f"replaying {', '.join(bench.policies)} side by side")
            running = [
                pool.submit(replay, bench, hosts, trace, mappings[k], policy, out, stop)
                for k, policy in enumerate(bench.policies)
            ]
            results = {policy: f.result() for policy, f in zip(bench.policies, running, strict=True)}
        else:
            results = {p: replay(bench, hosts, trace, mapping, p, out, stop) for p in bench.policies}
    finally:
        stop.set()  # replays still running side by side (one failed, or SIGTERM) end their waits
        hosts.down()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    ideal = sum((b - a) * throughput.get(len(p), 0.0) for a, b, p in spans) / trace.end_s
    elastic = results.get("elastic")
    report: dict[str, Any] = {"bench": "spot", "date": time.strftime("%Y-%m-%d")}
    if elastic is not None:
        plain = plain_losses(bench, 1 + max((s for s, _ in elastic["losses"]), default=-1))
        worst = max((abs(loss - plain[s]) / abs(plain[s]) for s, loss in elastic["losses"]), default=0.0)
        report.update(
            goodput=round(elastic["goodput"], 3),
            ideal=round(ideal, 3),
            goodput_over_ideal=round(elastic["goodput"] / ideal, 3) if ideal else None,
            morphs=elastic["morphs"],
            morph_s=elastic["morph_s"],
            steps_redone=elastic["steps_redone"],
            steps_lost=elastic["steps_lost"],
            steps_trained_twice=elastic["steps_trained_twice"],
            losses_vs_plain_max_rel=worst,
        )
    report["baselines"] = {
        p: {
            k: (round(v, 3) if isinstance(v, float) else v)
            for k, v in r.items()
            if k not in ("losses", "changes")
        }
        for p, r in results.items()
        if p != "elastic"
    }
    for p in report["baselines"]:
        if elastic is not None and results[p]["goodput"] > 0:
            report["baselines"][p]["elastic_over_this"] = round(elastic["goodput"] / results[p]["goodput"], 3)
    report["throughput_by_ranks"] = {str(n): round(v, 3) for n, v in throughput.items()}
    report["trace"] = {
        "source": trace.source,
        "duration_s": trace.end_s,
        "nodes": len(nodes),
        "availability": [[round(a, 1), round(b, 1), sorted(mapping[n] for n in p)] for a, b, p in spans],
    }
    report["elastic"] = {k: v for k, v in (elastic or {}).items() if k != "losses"}
    report["settings"] = asdict(bench)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def format_table(report: dict[str, Any]) -> str:
    lines = [f"spot bench, {report['trace']['duration_s']:.0f} s of {report['trace']['source']}"]
    lines.append(f"{'policy':<14}{'goodput':>10}{'launches':>10}{'morph_s':>9}{'redone':>8}")
    rows = [("elastic", report.get("elastic") or {})] + list(report["baselines"].items())
    for name, r in rows:
        if r:
            lines.append(
                f"{name:<14}{r['goodput']:>10.2f}{r['launches']:>10}{str(r['morph_s']):>9}{r['steps_redone']:>8}"
            )
    if "ideal" in report:
        lines.append(
            f"ideal {report['ideal']:.2f} samples/s; elastic / ideal = {report['goodput_over_ideal']}"
        )
        for name, r in report["baselines"].items():
            lines.append(f"elastic / {name} = {r.get('elastic_over_this')}")
    return "\n".join(lines)


def main(args: Any) -> int:
    bench = quick() if args.quick else full()
    given = getattr(args, "trace", None)
    trace = read_trace(Path(given) if given else QUICK_TRACE if args.quick else DEFAULT_TRACE)
    out = Path(
        getattr(args, "out", None) or Path.cwd() / "runs" / f"bench-spot-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    report = run(bench, trace, out.absolute())
    write_json_atomic(out / "spot.json", report)
    return print_report(report, format_table(report), args.json)


if __name__ == "__main__":
    print(json.dumps({"error": "run it as python -m varuna.bench spot"}))
