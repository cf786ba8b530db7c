"""The ``varuna`` command line: ``varuna run --pipeline P --data D train.py [args ...]``.

Everything after the script (or after ``-m module``) goes to the script untouched. More
subcommands (profile, plan, bench, resize) hang off the same parser as they arrive.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from varuna.errors import ConfigError, LaunchError

__all__ = ["main", "build_parser"]

EXAMPLE = "example: varuna run --pipeline 2 --data 2 train.py --lr 3e-4   (or: ... -m mypkg.train --lr 3e-4)"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``varuna`` with its subcommands."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``run`` subparser."""
    parser = argparse.ArgumentParser(prog="varuna", description="Pipeline x data parallel training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run a training script on P x D ranks under mpiexec",
        description="Run a script on pipeline x data ranks; rank r is stage r % P of replica r // P.",
        epilog=EXAMPLE,
    )
    run.add_argument("--pipeline", "-p", type=int, required=True, metavar="P", help="pipeline depth (stages)")
    run.add_argument(
        "--data", "-d", type=int, default=1, metavar="D", help="data-parallel replicas (default 1)"
    )
    run.add_argument("--hostfile", type=Path, metavar="FILE", help="hosts to run on (MPI hostfile)")
    run.add_argument(
        "--run-dir", type=Path, metavar="DIR", help="logs, failures, status (default runs/<time>)"
    )
    run.add_argument(
        "--timeout", type=float, metavar="S", help="stop the job after S seconds (exit code 124)"
    )
    run.add_argument(
        "--elastic",
        action="store_true",
        help="relaunch after morphs (varuna resize) and crashes, from the latest checkpoint",
    )
    run.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="with --elastic: crash restarts (default 3)"
    )
    run.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as `python -m MODULE`")
    run.add_argument(
        "target", nargs=argparse.REMAINDER, metavar="script.py [args ...]", help="script and its args"
    )
    resize = sub.add_parser(
        "resize",
        help="ask a running job to checkpoint and relaunch as a new P x D",
        description="Queue a new shape for the job in RUN_DIR and signal it to morph at the end of its step.",
    )
    resize.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    resize.add_argument("--pipeline", "-p", type=int, metavar="P")
    resize.add_argument("--data", "-d", type=int, metavar="D")
    resize.add_argument(
        "--gpus", type=int, metavar="N", help="choose P x D for N devices, keeping the global batch"
    )
    resize.add_argument("--no-signal", action="store_true", help="only queue the shape for the next morph")
    return parser, run


def _resize(args: argparse.Namespace) -> int:
    import json

    from varuna.morph import choose_shape, request_resize

    if args.gpus is not None:
        if args.pipeline is not None or args.data is not None:
            raise ConfigError("give either --gpus N or --pipeline P --data D, not both")
        info_path = args.run_dir / "engine.json"
        if not info_path.exists():
            raise ConfigError(
                f"{args.run_dir} has no engine.json yet (has the job started training?); give -p and -d"
            )
        shape = choose_shape(args.gpus, json.loads(info_path.read_text()))
        pipeline, data = shape.pipeline, shape.data
    elif args.pipeline is None or args.data is None:
        raise ConfigError("resize needs --pipeline P --data D, or --gpus N")
    else:
        pipeline, data = args.pipeline, args.data
    path = request_resize(args.run_dir, pipeline=pipeline, data=data, notify=not args.no_signal)
    print(f"varuna: requested {pipeline}x{data} for {args.run_dir} ({path.name})")
    return 0


def _split_target(argv: list[str], run: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Split ``run ...`` into varuna's options and the target's arguments, which pass untouched.

    The target starts at the first word that is neither an option nor an option's value, or right
    after ``-m MODULE``: ``varuna run -p 2 -m pkg.train --data 8`` gives ``--data 8`` to the module.
    """
    takes_value = {o for a in run._actions if a.nargs != 0 for o in a.option_strings}
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1 :]
        if word == "-m":
            return argv[: i + 2], argv[i + 2 :]
        if not word.startswith("-") or word == "-":
            return argv[:i], argv[i:]
        i += 2 if word in takes_value else 1
    return argv, []


def _run(args: argparse.Namespace) -> int:
    from varuna.launch import run_job

    if args.module is not None:
        script_argv = ["-m", args.module, *args.target]
    elif args.target:
        script_argv = list(args.target)
    else:
        raise ConfigError(f"nothing to run: give a script or -m MODULE ({EXAMPLE})")
    if args.elastic:
        from varuna.elastic import run_elastic

        return run_elastic(
            script_argv,
            pipeline=args.pipeline,
            data=args.data,
            run_dir=args.run_dir,
            hostfile=args.hostfile,
            max_restarts=args.max_restarts,
            timeout_s=args.timeout,
        )
    return run_job(
        script_argv,
        pipeline=args.pipeline,
        data=args.data,
        run_dir=args.run_dir,
        hostfile=args.hostfile,
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser, run = _parsers()
    argv = list(sys.argv[1:] if argv is None else argv)
    head, target = _split_target(argv, run) if argv[:1] == ["run"] else (argv, [])
    args = parser.parse_args(head)
    if args.command == "run":
        args.target = target
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "resize":
            return _resize(args)
        parser.error(f"unknown command {args.command!r}")
    except (ConfigError, LaunchError) as exc:
        print(f"varuna: error: {exc}", file=sys.stderr)
        return 2
    return 2
