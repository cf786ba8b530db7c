"""One job of the network benchmark: every rank runs this module, rank 0 writes the results.

    varuna run --pipeline 1 --data 4 --hostfile H -m varuna.bench.network.worker SPEC.json

SPEC.json (written by `varuna.bench.network.driver`) says the job's mode. "profile": the compute
profile of the model for the planner (`run_profile` at the bench's micro-batch size; rank 0 writes
RUN_DIR/profile.json). "measure": the model, the batch shape, the systems to build (each Varuna
shape P x D with its cut, DDP, torch.pipelining at P x D), whether to profile the network at each
rate, the number of link rates, the step counts, the folder of the rate handshake
(`varuna.bench.network.rates`) and the output file. Every system is built once, while the link is
unshaped (so start-up traffic is not measured); then for each rate the job waits for its turn at
that rate (the parent shapes the link and lets the bench's jobs measure one after another), probes
the link, profiles the network if asked (`profile_network`: what the planner decides with; with
`sharing_rounds` also how much ranks sharing the cores slow each other, `measure_slowdown`), and
every system runs `warmup` + `steps` steps on the same global batches, the systems alternating step
by step (a shared host's speed drifts; adjacent steps see the same host). Where a rate gives the job
several turns (`turns_per_rate`; the other jobs measure in between, `varuna.bench.network.rates`)
the timed steps are split between them; the rate's first turn starts with `warmup` untimed rounds and
each later one with `turn_warmup` (default 0: the link and the engines are warm from the first);
a system's `step_s` is the median over every turn's timed steps (`turn_step_s` keeps them by turn). A step is timed from a barrier that lines the ranks up to the end of the optimizer step;
its time is the slowest rank's. Where `gauge_repeats` > 0 rank 0 times the model's compute before
the first timed round and after each (`RoundGauges`, `compute_gauge`): the host's speed while this
job measured at that rate, their median `compute_s`, with which the planner prices this job's
configurations.

Every system trains the same GPT (same seed, so the same initial weights) on the same batches with
AdamW, and every system has run the same steps at each point: their losses agree step by step.
"""

from __future__ import annotations

import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from varuna.bench.common import (
    LR,
    build_model,
    forward_backward_s,
    gather,
    global_batches,
    run_worker,
    worker_log,
)
from varuna.bench.network.ddp_baseline import DDPRunner
from varuna.bench.network.rates import wait_rate
from varuna.bench.network.report import system_key
from varuna.bench.pipeline.torch_baseline import TorchRunner


class Runner(Protocol):
    """One system of the job: `step` trains on one global batch and returns a loss (or None where
    this rank holds no loss)."""

    def step(self, batch: dict[str, Tensor]) -> float | None: ...


class _VarunaRunner:
    """A Varuna engine at one P x D; `step` gives it this replica's share of the global batch."""

    def __init__(self, spec: dict[str, Any], P: int, D: int, example: dict[str, Tensor]) -> None:
        from varuna import Varuna

        partition = spec["partition"]  # a name, or the planner's cut per P
        if isinstance(partition, dict) and P > 1:
            partition = partition[str(P)]
        self.engine = Varuna(
            build_model(spec["model"]),
            pipeline=P,
            data=D,
            global_batch_size=spec["global_batch_size"],
            micro_batch_size=spec["micro_batch_size"],
            schedule=spec["schedule"],
            example_batch=example,
            partition=partition if P > 1 else "uniform",
        )
        self.engine.set_optimizer(torch.optim.AdamW(self.engine.parameters(), lr=LR))
        self.share = spec["global_batch_size"] // D

    def step(self, batch: dict[str, Tensor]) -> float | None:
        lo = self.engine.replica * self.share
        return self.engine.step({k: v[lo : lo + self.share] for k, v in batch.items()})


def build(spec: dict[str, Any], example: dict[str, Tensor]) -> dict[str, Runner]:
    """Every system of the spec, in order; torch.pipelining (at its P x D) is cut where Varuna's
    engine of the same P cut the model (the spec's driver puts that engine first)."""
    import torch.distributed as dist

    runners: dict[str, Runner] = {}
    boundaries: dict[int, list[int]] = {}
    for system in spec["systems"]:
        key, P, D = system_key(system), system["pipeline"], system["data"]
        if system["system"] == "varuna":
            runner = _VarunaRunner(spec, P, D, example)
            boundaries[P] = list(runner.engine.partition.boundaries)
            runners[key] = runner
        elif system["system"] == "ddp":
            runners[key] = DDPRunner(spec)
        else:  # torch.pipelining: D replicas of a P-stage pipeline
            cut = {spec["schedule"]: boundaries[P]}
            runners[key] = TorchRunner(
                spec | {"pipeline": P, "data": D, "boundaries_by_schedule": cut}, spec["schedule"]
            )
        if dist.get_rank() == 0:
            where = f", boundaries {boundaries[P]}" if P > 1 and system["system"] == "varuna" else ""
            worker_log(f"built {key}{where}")
    return runners


def measure(
    runners: dict[str, Runner],
    batches: list[dict[str, Tensor]],
    after_round: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Each system's step on each batch, the systems in turn (the order rotating each round), and
    `after_round(k)` (collective) after round k where given; per system its slowest rank's step
    times and the losses every rank returned."""
    import torch.distributed as dist

    names = list(runners)
    step_s: dict[str, list[float]] = {k: [] for k in names}
    losses: dict[str, list[float | None]] = {k: [] for k in names}
    for k, batch in enumerate(batches):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(runners[name].step(batch))
            step_s[name].append(time.perf_counter() - t0)
        if after_round is not None:
            after_round(k)
    every = gather({"step_s": step_s, "losses": losses})
    return {
        k: {
            "step_s": [max(r["step_s"][k][i] for r in every) for i in range(len(batches))],
            "losses": [[r["losses"][k][i] for r in every] for i in range(len(batches))],
        }
        for k in names
    }


def probe_link(hosts: list[str], rate: float | None) -> float:
    """The link's rate as gloo sees it, in Mbit/s: rank 0 sends about half a second's worth of bytes
    at `rate` (64 MiB unshaped) to the first rank on another host, which answers with one byte."""
    import torch.distributed as dist

    rank = dist.get_rank()
    peer = next(r for r, host in enumerate(hosts) if host != hosts[0])
    size = 64 * 2**20 if rate is None else int(min(max(rate * 1e6 / 8 / 2, 2**20), 64 * 2**20))
    dist.barrier()
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(torch.zeros(size, dtype=torch.uint8), dst=peer)
        dist.recv(torch.zeros(1, dtype=torch.uint8), src=peer)
    elif rank == peer:
        dist.recv(torch.empty(size, dtype=torch.uint8), src=0)
        dist.send(torch.zeros(1, dtype=torch.uint8), dst=0)
    seconds = gather(time.perf_counter() - t0)[0]
    return size * 8 / seconds / 1e6


def network_probe_bytes(rate: float | None) -> int:
    """The point-to-point message of the network profile at `rate` Mbit/s: about half a second's
    worth, between 1 and 4 MiB (4 MiB unshaped, `profile_network`'s default)."""
    return 4 * 2**20 if rate is None else int(min(max(rate * 1e6 / 8 / 2, 2**20), 4 * 2**20))


def _global_loss(kind: str, per_rank: list[float | None]) -> float:
    """The step's global mean loss from every rank's return: DDP's ranks and the last stage of each
    torch.pipelining replica return their replica's mean (equal shares: their mean is the global
    one), Varuna's ranks the global mean where they hold it."""
    held = [x for x in per_rank if x is not None]
    return statistics.fmean(held) if kind in ("ddp", "torch.pipelining") else held[0]


def profile(spec: dict[str, Any]) -> None:
    """The compute profile for the planner, on every rank: `run_profile` of the bench's model at
    its micro-batch size (with the network, the slowdown of ranks sharing cores and the runtime's
    cost per action); rank 0 writes ``spec["run_dir"]/profile.json``."""
    from varuna import Varuna
    from varuna.profile.measure import run_profile

    run_profile(
        build_model(spec["model"]),
        global_batches(spec)[0],
        micro_batch_sizes=[spec["micro_batch_size"]],
        repeats=spec["repeats"],
        run_dir=spec["run_dir"],
        progress=False,
        engine=Varuna,
    )


def compute_gauge(model: torch.nn.Module | None, batch: dict[str, Tensor], spec: dict[str, Any]) -> float:
    """Collective: seconds of forward + backward of one micro-batch through the whole model, as the
    compute profile times it (`profile_model`, its median passes summed over the segments), on rank 0
    while the others wait; every rank gets rank 0's figure."""
    import torch.distributed as dist

    from varuna.profile.measure import profile_model

    dist.barrier()
    seconds = 0.0
    if model is not None:
        m = spec["micro_batch_size"]
        segments = profile_model(
            model, batch, micro_batch_sizes=(m,), repeats=spec["gauge_repeats"], progress=False
        )
        seconds = forward_backward_s(segments, m)
    box = [seconds]
    dist.broadcast_object_list(box, src=0)
    return float(box[0])


class RoundGauges:
    """`measure`'s `after_round`: the compute gauge (`compute_gauge`) after the last of the turn's
    `warmup` untimed rounds (round ``warmup - 1``; call it with -1 before the first round where a
    rate's first turn has none) and after each timed round: the host's speed over the rounds
    (`seconds`), rather than only on either side of them, as a shared host can slow down for a few
    rounds and recover. Set `warmup` for each turn."""

    def __init__(self, model: torch.nn.Module | None, batch: dict[str, Tensor], spec: dict[str, Any]) -> None:
        self.model, self.batch, self.spec = model, batch, spec
        self.warmup = spec["warmup"]
        self.seconds: list[float] = []

    def __call__(self, k: int) -> None:
        if k >= self.warmup - 1:
            self.seconds.append(compute_gauge(self.model, self.batch, self.spec))


def run(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The spec's mode: "profile" (`profile`), or "measure": build every system, then measure them
    all at each rate the parent sets; rank 0's report."""
    import torch.distributed as dist

    from varuna.comm.rendezvous import init_distributed
    from varuna.profile.network import profile_network
    from varuna.profile.slowdown import measure_slowdown

    if spec["mode"] == "profile":
        profile(spec)
        return None

    rank, _ = init_distributed()
    hosts = gather(socket.gethostname())
    warmup, turn_warmup = spec["warmup"], spec.get("turn_warmup", 0)
    batches = global_batches(spec)
    runners = build(spec, batches[0])
    gauged = spec.get("gauge_repeats", 0) > 0
    sharing_rounds = spec.get("sharing_rounds", 0) if spec["profile_network"] else 0
    # a model of its own on every rank reads the cores' sharing; rank 0's also times the gauge
    probe_model = build_model(spec["model"]) if sharing_rounds or (gauged and rank == 0) else None
    gauge_model = probe_model if gauged and rank == 0 else None
    kinds = {system_key(s): s["system"] for s in spec["systems"]}
    control = Path(spec["control"])
    steps_per_rate = spec.get("steps_per_rate", [spec["steps"]] * spec["rates"])
    turns_per_rate = spec.get("turns_per_rate", [1] * spec["rates"])
    # every turn of the run in order, as the parent numbers them: (rate index, turn at that rate)
    plan = [(i, k) for i, turns in enumerate(turns_per_rate) for k in range(turns)]
    points: list[dict[str, Any]] = []
    for number in range(len(plan) + 1):  # the last ask: the parent unshapes the link
        rate = wait_rate(control, number, ask=rank == 0, timeout_s=spec["rate_wait_s"])
        dist.barrier()
        if number == len(plan):
            break
        index, turn = plan[number]
        turns, steps = turns_per_rate[index], steps_per_rate[index]
        if turn == 0:
            t0 = time.perf_counter()
            link = probe_link(hosts, rate)
            point: dict[str, Any] = {"index": index, "rate_mbit": rate, "link_mbit": link, "systems": {}}
            if spec["profile_network"]:
                t1 = time.perf_counter()
                point["network"] = profile_network(p2p_bytes=network_probe_bytes(rate)).to_json()
                point["network_profile_s"] = time.perf_counter() - t1
            if sharing_rounds:
                assert probe_model is not None
                t1 = time.perf_counter()
                slowdown = measure_slowdown(
                    probe_model, batches[0], micro_batch_size=spec["micro_batch_size"], rounds=sharing_rounds
                )
                point["compute_slowdown"] = {str(n): f for n, f in sorted(slowdown.items())}
                point["sharing_profile_s"] = time.perf_counter() - t1
            point["turns"] = turns
            points.append(point)
            # one gauge for every turn of the rate: its readings run on over the turns
            gauges = RoundGauges(gauge_model, batches[0], spec) if gauged else None
            first = 0  # the turn's first global batch: each turn goes on where the last stopped
        point = points[-1]
        mine = steps // turns + (turn < steps % turns)  # this turn's timed steps
        untimed = warmup if turn == 0 else turn_warmup
        if gauges is not None:
            gauges.warmup = untimed
            if untimed == 0 and turn == 0:
                gauges(-1)  # before the rate's first timed round (else after the last untimed one)
        measured = measure(runners, batches[first : first + untimed + mine], gauges)
        first += untimed + mine
        for key, m in measured.items():
            seen = point["systems"].setdefault(key, {"turn_step_s": [], "warmup_step_s": [], "losses": []})
            seen["turn_step_s"].append(m["step_s"][untimed:])
            seen["warmup_step_s"] += [round(t, 5) for t in m["step_s"][:untimed]]
            seen["losses"] += [_global_loss(kinds[key], per) for per in m["losses"]]
        if turn < turns - 1:
            continue
        for seen in point["systems"].values():  # the median over every turn's timed steps
            timed = [t for steps_of_turn in seen["turn_step_s"] for t in steps_of_turn]
            seen["step_s"] = statistics.median(timed)
            seen["timed_step_s"] = [round(t, 5) for t in timed]
            seen["turn_step_s"] = [[round(t, 5) for t in ts] for ts in seen["turn_step_s"]]
        if gauges is not None:  # the median over every timed round of every turn, as step_s is
            point["compute_s"] = statistics.median(gauges.seconds)
            point["compute_gauges_s"] = [round(g, 5) for g in gauges.seconds]
        if rank == 0:
            rates = ", ".join(
                f"{k} {spec['global_batch_size'] / s['step_s']:.2f}" for k, s in point["systems"].items()
            )
            shaped = "unshaped" if rate is None else f"{rate:g} Mbit/s"
            worker_log(
                f"{shaped} (gloo saw {point['link_mbit']:.0f} Mbit/s, {turns} turn{'s' * (turns > 1)}): "
                f"{rates} samples/s ({time.perf_counter() - t0:.0f} s)"
            )
    for runner in runners.values():
        if isinstance(runner, _VarunaRunner):
            runner.engine.close()
    return {"hosts": hosts, "points": points, "batches": len(batches), "warmup": warmup}


def main(argv: list[str]) -> None:
    run_worker(argv, run)


if __name__ == "__main__":
    main(sys.argv[1:])
