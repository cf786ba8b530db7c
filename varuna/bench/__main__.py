"""``python -m varuna.bench (pipeline | morph | telemetry | planner | standin | memory | faults | network | spot | checkpoint) [--json] [--quick]``: run one benchmark, print its report."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from types import FrameType

from varuna.errors import ConfigError, LaunchError

BENCHES = {
    "pipeline": (
        "Varuna's schedules vs torch.distributed.pipelining and one process",
        "Throughput of Varuna's schedules (gpipe, 1f1b, eager-1f1b, varuna, zb-h1, interleaved-1f1b, zb-v) "
        "and torch.distributed.pipelining's (GPipe, 1F1B, ZB1P, interleaved 1F1B, ZB-V, paired step by step "
        "at the same cuts) at P = 2 and 4 against one process, on the same GPT, weights and batches.",
        "tiny model, few steps: a smoke run of every path",
    ),
    "morph": (
        "time of a resize: checkpoint, relaunch, load, first step in the new shape",
        "Resize an elastic 2x1 job of a ~100M-parameter GPT to 1x2 with `varuna resize` and time each "
        "part, from the request to the first resumed step; the checkpoint's write rate against a plain "
        "sequential write on the same disk.",
        "tiny model: a smoke run of every path",
    ),
    "telemetry": (
        "throughput with telemetry on vs off in one job; the workbench's refresh rate",
        "A 2x1 GPT job under a live JobController, its telemetry paused and recording on alternate "
        "steps, compared in adjacent pairs: samples/s off and on and the overhead with its spread; then "
        "the widget refresh rate for 4 stages x 64 micro-batches.",
        "tiny model, few steps: a smoke run of every path",
    ),
    "standin": (
        "what stand-ins cost a stage's forward on transformers GPT-2 and Llama",
        "Cut 12-block transformers GPT-2 and Llama with auto_cut, run them at P = 2 and 4 with even "
        "stages, and time each stage's forward with the stand-in work (glue on values other stages "
        "compute, skipped modules inferred on meta) measured inside it.",
        "small models, P = 2: a smoke run",
    ),
    "planner": (
        "the planner's predicted step time against the measured one, over P x D, micro-batch, schedule",
        "Profile a GPT on 4 ranks, predict the step time of 1x2, 2x1, 2x2 and 4x1 with two micro-batch "
        "sizes and two schedules, measure each, and report the errors, their rank correlation and the "
        "gap between the predicted-best and the measured-best configuration.",
        "tiny model, one round: a smoke run",
    ),
    "memory": (
        "each rank's memory when no rank holds the whole model, the estimate's error, the largest fit",
        "A ~350M-parameter transformers Llama built on the meta device and loaded with weights= from a "
        "sharded safetensors folder, trained at P = 1, 2, 4: each rank's baseline and peak resident "
        "memory against the engine's estimate; torch.distributed.pipelining's meta-device recipe beside "
        "it at P = 2 and 4; and the most layers whose estimate fits a per-rank limit at each P, each "
        "verified by a real run under memory_limit=.",
        "a ~38M-parameter Llama, limit 1GiB; torch.pipelining and the verifying run at P = 2 only",
    ),
    "faults": (
        "faults, attacks and bad inputs against the real library: each must hold",
        "Forged checkpoints, signed-message attacks, leaked keys, killed and stopped processes, full "
        "disks and bad inputs, each provoked for real (engine in-process, the CLI, multi-rank jobs) with "
        "what was expected and what was observed.",
        "skip the cases that need multi-rank jobs",
    ),
    "network": (
        "pipelining against data parallelism over a shaped link between two hosts (needs root)",
        "4 ranks on 2 network-namespace hosts whose link is shaped (tc tbf) to several rates: at each, "
        "the samples/s of Varuna at 1x4, 2x2 (replicas across hosts, and stages across hosts) and 4x1, "
        "PyTorch DistributedDataParallel at 1x4 and torch.distributed.pipelining at 4x1 and 2x2, on the "
        "same GPT, weights, batches and optimizer; the planner's pick from the network profiled at each "
        "rate beside the measured best; the rate below which pipelining wins, and a plot.",
        "tiny model, unshaped and 20 Mbit/s, few steps: a smoke run of every path",
    ),
    "spot": (
        "goodput while spot hosts come and go, against a static job and restart-only (needs root)",
        "A job on one namespace host per trace node replays a host-availability trace (the shipped "
        "default, or --trace FILE in Bamboo's ms,add|remove,node format, plus ms,notice,node,lead_ms), "
        "hosts taken without warning or after a notice and added back; the goodput against the ideal "
        "(the measured samples/s of the nodes present, over time), morphs, seconds per morph, steps "
        "redone, and the same trace replayed by a static job and by restart-only.",
        "a 28 s replay of the quick trace (two nodes: a notice, a return, a removal), fewer measured steps",
    ),
    "checkpoint": (
        "the step-time cost of a background checkpoint against a blocking one and none",
        "One rank trains a ~6.9M-parameter GPT in three modes, each on a fresh engine with the same "
        "weights and data, rotated from round to round: no checkpoint, checkpoint(blocking=False) and "
        "checkpoint() every few steps; each mode's mean step time (the checkpoint call included), its "
        "overhead over no checkpoint, and a background checkpoint's copy and write time.",
        "tiny model, one round of few steps: a smoke run of every path",
    ),
}
"""name -> (one-line help, description, what --quick does); each lives in `varuna.bench.<name>`."""

EXTRA_OPTIONS: dict[str, list[tuple[str, dict[str, str]]]] = {
    "faults": [("--only", {"metavar": "SUBSTRING", "help": "run only the cases whose name holds SUBSTRING"})],
    "memory": [
        (
            "--limit",
            {"metavar": "SIZE", "help": "per-rank limit of the largest-model search (2GiB; quick 1GiB)"},
        ),
        ("--keep", {"action": "store_true", "help": "keep the weights folder, specs and logs"}),
    ],
    "planner": [
        ("--scale", {"action": "store_true", "help": "plan 8..1024 GPUs of a paper GPT; report plan time"})
    ],
    "spot": [
        ("--trace", {"metavar": "FILE", "help": "a host-availability trace (default: the shipped one)"}),
        (
            "--out",
            {"metavar": "DIR", "help": "the run's folder: jobs, logs, spot.json (runs/bench-spot-<time>)"},
        ),
    ],
    "network": [
        (
            "--out",
            {
                "metavar": "DIR",
                "help": "the run's folder: jobs, logs, network.png (runs/bench-network-<time>)",
            },
        )
    ],
}
"""name -> further options of that benchmark: (flag, argparse keywords)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m varuna.bench``; one subparser per benchmark."""
    parser = argparse.ArgumentParser(prog="python -m varuna.bench", description="Varuna benchmarks.")
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (help_, description, quick) in BENCHES.items():
        bench = sub.add_parser(name, help=help_, description=description)
        bench.add_argument(
            "--json", action="store_true", help="print one JSON object on stdout (table to stderr)"
        )
        bench.add_argument("--quick", action="store_true", help=quick)
        for flag, kw in EXTRA_OPTIONS.get(name, []):
            bench.add_argument(flag, **kw)  # type: ignore[arg-type]
    return parser


class Terminated(BaseException):
    """Raised in the main thread by a SIGTERM (`kill`, a scheduler's time limit, a test's timeout):
    a BaseException, so that no bench's ``except Exception`` takes it for its own error, and every
    ``finally`` on the way out runs (namespace hosts down, links unshaped, jobs stopped)."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """Run one bench; 1 on a bench's typed error, 128 + SIGTERM after a SIGTERM (cleaned up)."""
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return int(importlib.import_module(f"varuna.bench.{args.bench}").main(args))
    except (ConfigError, LaunchError) as exc:
        print(f"varuna bench: error: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        print(f"varuna bench: {args.bench}: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
