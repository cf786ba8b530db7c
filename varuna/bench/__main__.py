"""``python -m varuna.bench (pipeline | morph | telemetry | planner) [--json] [--quick]``: run one benchmark, print its report."""

from __future__ import annotations

import argparse
import sys

from varuna.errors import ConfigError, LaunchError


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m varuna.bench``; one subparser per benchmark."""
    parser = argparse.ArgumentParser(prog="python -m varuna.bench", description="Varuna benchmarks.")
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    pipe = sub.add_parser(
        "pipeline",
        help="Varuna's schedules vs torch.distributed.pipelining and one process",
        description="Throughput of Varuna (gpipe, 1f1b, varuna) and torch.distributed.pipelining "
        "(GPipe, 1F1B) at P = 2 and 4 against one process, on the same GPT, weights and batches.",
    )
    pipe.add_argument("--json", action="store_true", help="print one JSON object on stdout (table to stderr)")
    pipe.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke run of every path")
    morph = sub.add_parser(
        "morph",
        help="time of a resize: checkpoint, relaunch, load, first step in the new shape",
        description="Resize an elastic 2x1 job of a ~100M-parameter GPT to 1x2 with `varuna resize` and time "
        "each part, from the request to the first resumed step; the checkpoint's write rate against a "
        "plain sequential write on the same disk.",
    )
    morph.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout (table to stderr)"
    )
    morph.add_argument("--quick", action="store_true", help="tiny model: a smoke run of every path")
    telemetry = sub.add_parser(
        "telemetry",
        help="throughput with telemetry on vs off in one job; the workbench's refresh rate",
        description="A 2x1 GPT job under a live JobController, its telemetry paused and recording on "
        "alternate steps, compared in adjacent pairs: samples/s off and on and the overhead with its "
        "spread; then the widget refresh rate for 4 stages x 64 micro-batches.",
    )
    telemetry.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout (table to stderr)"
    )
    telemetry.add_argument(
        "--quick", action="store_true", help="tiny model, few steps: a smoke run of every path"
    )
    planner = sub.add_parser(
        "planner",
        help="the planner's predicted step time against the measured one, over P x D, micro-batch, schedule",
        description="Profile a GPT on 4 ranks, predict the step time of 1x2, 2x1, 2x2 and 4x1 with two "
        "micro-batch sizes and two schedules, measure each, and report the errors, their rank correlation "
        "and the gap between the predicted-best and the measured-best configuration.",
    )
    planner.add_argument(
        "--json", action="store_true", help="print one JSON object on stdout (table to stderr)"
    )
    planner.add_argument("--quick", action="store_true", help="tiny model, one round: a smoke run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.bench == "pipeline":
            from varuna.bench import pipeline

            return pipeline.main(args)
        if args.bench == "morph":
            from varuna.bench import morph

            return morph.main(args)
        if args.bench == "telemetry":
            from varuna.bench import telemetry

            return telemetry.main(args)
        if args.bench == "planner":
            from varuna.bench import planner

            return planner.main(args)
    except (ConfigError, LaunchError) as exc:
        print(f"varuna bench: error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
