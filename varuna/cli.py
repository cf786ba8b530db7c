"""The ``varuna`` command line: ``varuna run --pipeline P --data D train.py [args ...]``.

Everything after the script (or after ``-m module``) goes to the script untouched. The other
subcommands (resize, notice, plan, profile, consolidate) hang off the same parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from varuna.errors import CheckpointError, ConfigError, LaunchError

__all__ = ["main", "build_parser"]

EXAMPLE = "example: varuna run --pipeline 2 --data 2 train.py --lr 3e-4   (or: ... -m mypkg.train --lr 3e-4)"


class _Version(argparse.Action):
    """``varuna --version``: ``varuna 0.1.0 (torch 2.13.0+cpu)``, read from the installed metadata, so
    torch's version comes without importing torch (a second or more)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import PackageNotFoundError, version

        import varuna

        try:
            torch = f"torch {version('torch')}"
        except PackageNotFoundError:
            torch = "torch not installed"
        print(f"varuna {varuna.__version__} ({torch})")  # stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``varuna`` with its subcommands."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and the ``run`` subparser."""
    from varuna.planner.cluster import PLACEMENTS

    parser = argparse.ArgumentParser(prog="varuna", description="Pipeline x data parallel training.")
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="print varuna's and torch's versions and exit"
    )
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
        "--placement",
        choices=PLACEMENTS,
        default="block",
        help="how ranks sit on the hosts: block fills each host in rank order (default), cyclic deals "
        "ranks to the hosts in turn, rank r on host r mod H (`varuna plan` says which)",
    )
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
    run.add_argument(
        "--watch-hosts",
        action="store_true",
        help="with --elastic and --hostfile: follow the hostfile as it changes (edits, `varuna hosts`): "
        "shrink when a host goes, grow onto hosts that stayed --settle seconds",
    )
    run.add_argument(
        "--settle",
        type=float,
        default=30.0,
        metavar="S",
        help="with --watch-hosts: seconds a larger host set must stay before the job grows (default 30)",
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
    resize.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running job's run directory")
    resize.add_argument("--pipeline", "-p", type=int, metavar="P", help="the new pipeline depth")
    resize.add_argument(
        "--data", "-d", type=int, metavar="D", help="the new number of data-parallel replicas"
    )
    resize.add_argument(
        "--gpus",
        type=int,
        metavar="N",
        help="choose P x D for N devices, keeping the global batch: the planner's best when RUN_DIR has "
        "a profile.json, else the pipeline depth closest to the current one",
    )
    resize.add_argument("--no-signal", action="store_true", help="only queue the shape for the next morph")
    _add_hosts_parser(sub)
    _add_notice_parser(sub)
    _add_plan_parser(sub)
    _add_profile_parser(sub)
    _add_consolidate_parser(sub)
    return parser, run


def _add_hosts_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    hosts = sub.add_parser(
        "hosts",
        help="add, remove or list the hosts of a running job that watches its hostfile",
        description="Edit the hostfile the job in RUN_DIR watches (`varuna run --elastic --watch-hosts`): "
        "a host removed makes the job checkpoint and shrink at the end of its step; hosts added are grown "
        "onto once they have stayed the job's settle time. `list` shows the live host set.",
        epilog="example: varuna hosts runs/gpt add node7:4",
    )
    hosts.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the job's run directory")
    hosts.add_argument("action", choices=("add", "remove", "list"), help="what to do")
    hosts.add_argument(
        "hosts", nargs="*", metavar="HOST[:SLOTS]", help="hosts to add (default 1 slot) or remove"
    )


def _add_notice_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    notice = sub.add_parser(
        "notice",
        help="tell a running job that hosts go away at a deadline: it checkpoints and exits before it",
        description="Write a preemption notice for the job in RUN_DIR: its ranks train on while one more "
        "step and a checkpoint still fit before the deadline, then checkpoint and exit with status 75; "
        "an elastic job that follows its hosts (--watch-hosts) relaunches without the named ones.",
        epilog="example: varuna notice runs/gpt --deadline 90s --host node3 --reason 'spot reclaim'",
    )
    notice.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the running job's run directory")
    notice.add_argument(
        "--deadline",
        required=True,
        metavar="DURATION",
        help="how long from now until the hosts go away: seconds (90) or 90s, 2min, 1h",
    )
    notice.add_argument(
        "--host",
        dest="hosts",
        action="append",
        metavar="HOST",
        help="a host that goes away (repeat for several; default: all of them)",
    )
    notice.add_argument("--reason", default="varuna notice", metavar="TEXT", help="said in the job's events")


def _notice(args: argparse.Namespace) -> int:
    import time

    from varuna.launch.notices import launch_info, parse_duration, post_stop

    seconds = parse_duration(args.deadline, what="--deadline")
    run_dir: Path = args.run_dir
    if not (run_dir / "job.json").is_file():
        raise ConfigError(
            f"{run_dir} is not a varuna run directory (it has no job.json): give the --run-dir of a job "
            "started with `varuna run` (or the workbench)"
        )
    info = launch_info(run_dir) or {}
    running = isinstance(info.get("job_id"), str) and "end" not in info
    job = info["job_id"] if running else None
    deadline = time.time() + seconds
    path = post_stop(run_dir, reason=args.reason, job=job, deadline=deadline, hosts=args.hosts)
    hosts = ", ".join(sorted(args.hosts)) if args.hosts else "all hosts"
    when = time.strftime("%H:%M:%S", time.localtime(deadline))
    who = f"launch {job}" if job else "whichever launch runs"
    print(
        f"varuna: notice for {who} in {run_dir}: {hosts} go away in {seconds:g} s (at {when}); "
        f"its ranks checkpoint and exit before then ({path.name})"
    )
    if not running:
        print(
            f"varuna: no launch of {run_dir} runs now (its job.json says it ended), so no rank acts on "
            "the notice",
            file=sys.stderr,
        )
    return 0


def _add_consolidate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    consolidate = sub.add_parser(
        "consolidate",
        help="write the plain model's state dict as Hugging Face safetensors from a checkpoint saved at any P x D",
        description="Read a checkpoint (a step directory, or the latest under a checkpoints/ or run "
        "directory) and write the plain model's state_dict() to OUT: a folder gets Hugging Face's "
        "sharded layout (model-00001-of-0000N.safetensors and model.safetensors.index.json, read and "
        "written one shard at a time), a name ending in .safetensors one file, for model.load_state_dict.",
        epilog="example: varuna consolidate runs/gpt out/gpt --max-shard-size 2GB",
    )
    consolidate.add_argument(
        "checkpoint", type=Path, metavar="CHECKPOINT", help="step, checkpoints/ or run dir"
    )
    consolidate.add_argument(
        "out", type=Path, metavar="OUT", help="a folder (sharded), or the .safetensors file to write"
    )
    consolidate.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="the largest shard, e.g. 5GB, 200MB or 10MiB (GB is 10**9 bytes, as in Hugging Face; "
        "default 5GB); with one file, the most read from the checkpoint at once",
    )


def _consolidate(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from varuna.checkpoint.consolidation import consolidate, find_checkpoint, shard_limit, written_files

    limit = shard_limit(args.max_shard_size)
    source = find_checkpoint(args.checkpoint)
    out = consolidate(source, args.out, max_shard_size=limit)
    files = written_files(out)
    tensors = 0
    for f in files:
        with safe_open(str(f), framework="pt") as opened:
            tensors += len(list(opened.keys()))
    nbytes = sum(f.stat().st_size for f in files)
    what = f"{len(files)} safetensors files" if len(files) > 1 else "1 safetensors file"
    print(f"varuna: wrote {out} ({what}, {tensors} tensors, {nbytes} bytes) from {source}")
    return 0


def _add_plan_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = sub.add_parser(
        "plan",
        help="rank P x D x micro-batch size x schedule for N devices from a profile",
        description="Simulate every configuration that fits and print them ranked by predicted step time.",
        epilog="example: varuna plan --gpus 8 --memory 16GiB --profile runs/gpt/profile.json --global-batch 32",
    )
    plan.add_argument("--gpus", type=int, required=True, metavar="N", help="devices to use (P x D = N)")
    plan.add_argument("--memory", required=True, metavar="SIZE", help="memory per device, e.g. 16GiB, 80GB")
    plan.add_argument(
        "--profile", type=Path, required=True, metavar="FILE", help="the cost table (RUN_DIR/profile.json)"
    )
    plan.add_argument("--global-batch", type=int, required=True, metavar="B", help="samples per step")
    plan.add_argument("--top", type=int, default=10, metavar="K", help="show the best K (default 10)")
    plan.add_argument("--json", action="store_true", help="print the result as one JSON object")
    hosts = plan.add_argument_group(
        "hosts",
        "spread the GPUs over hosts; within a host the profile's network applies (default: the profile's "
        "gpus_per_host, else one host)",
    )
    hosts.add_argument(
        "--gpus-per-host", type=int, metavar="G", help="GPUs on each host, filled in rank order"
    )
    hosts.add_argument(
        "--inter-host-gbit",
        type=float,
        metavar="GBIT",
        help="network between hosts, Gbit/s per host shared by its GPUs (default: the profile's, else 100)",
    )
    hosts.add_argument(
        "--inter-host-latency-us",
        type=float,
        metavar="US",
        help="latency of a message between hosts, microseconds (default: the profile's, else 20)",
    )
    hosts.add_argument(
        "--intra-host-gbit",
        type=float,
        metavar="GBIT",
        help="bandwidth between GPUs of a host, Gbit/s (default: the profile's point-to-point)",
    )
    hosts.add_argument(
        "--intra-host-latency-us",
        type=float,
        metavar="US",
        help="latency within a host, microseconds (default: the profile's point-to-point)",
    )


def _plan(args: argparse.Namespace) -> int:
    import json
    import time

    from varuna.planner.cluster import Cluster
    from varuna.planner.costs import CostTable
    from varuna.planner.limits import explain, format_limits
    from varuna.planner.search import plan

    def scaled(value: float | None, factor: float) -> float | None:
        return None if value is None else value * factor

    table = CostTable.load(args.profile)
    cluster = Cluster.from_network(
        table.network,
        gpus_per_host=args.gpus_per_host,
        inter_bandwidth_Bps=scaled(args.inter_host_gbit, 1e9 / 8),
        inter_latency_s=scaled(args.inter_host_latency_us, 1e-6),
        intra_bandwidth_Bps=scaled(args.intra_host_gbit, 1e9 / 8),
        intra_latency_s=scaled(args.intra_host_latency_us, 1e-6),
    )
    start = time.perf_counter()
    result = plan(
        table,
        gpus=args.gpus,
        memory_bytes=args.memory,
        global_batch_size=args.global_batch,
        cluster=cluster,
    )
    took = time.perf_counter() - start
    if args.json:
        out = result.to_json(top=args.top)
        out["limits"] = explain(result)
        out["plan_s"] = took
        print(json.dumps(out, indent=1))
    else:
        hosts = f" on {cluster.hosts(args.gpus)} hosts of {cluster.gpus_per_host}" if cluster else ""
        print(result.format(top=args.top))
        print("\n".join(format_limits(result)))
        print(f"planned {args.gpus} GPUs{hosts} in {took:.2f} s")
        if cluster is not None and result.ranked and result.best.placement:
            best, n = result.best, cluster.hosts(args.gpus)
            print(
                f"launch the best with: varuna run -p {best.pipeline} -d {best.data} --placement "
                f"{best.placement} --hostfile FILE train.py  (FILE: {n} hosts, {cluster.gpus_per_host} slots each)"
            )
    return 0


def _add_profile_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    profile = sub.add_parser(
        "profile",
        help="measure per-segment compute, memory and the network; write RUN_DIR/profile.json",
        description="Run a training script under the profiler: it stops at Varuna(...), profiles the "
        "model on its example_batch and the network between the ranks, and writes the cost table.",
        epilog="example: varuna profile --gpus 2 --micro-batch-sizes 1,2,4 train.py --lr 3e-4",
    )
    profile.add_argument("--gpus", type=int, default=2, metavar="N", help="ranks to launch (default 2)")
    profile.add_argument("--run-dir", type=Path, metavar="DIR", help="default runs/profile-<time>")
    profile.add_argument(
        "--micro-batch-sizes", default="1,2,4", metavar="M,M,...", help="sizes to profile (default 1,2,4)"
    )
    profile.add_argument("--repeats", type=int, default=3, metavar="N", help="timed passes per size (3)")
    profile.add_argument("--hostfile", type=Path, metavar="FILE", help="hosts to run on (MPI hostfile)")
    profile.add_argument("--timeout", type=float, metavar="S", help="stop the job after S seconds")
    profile.add_argument("-m", dest="module", metavar="MODULE", help="profile a module, as `python -m`")
    profile.add_argument(
        "target",
        nargs=argparse.REMAINDER,
        metavar="script.py [args ...]",
        help="the training script and its arguments, as `varuna run` takes them",
    )


def _profile(args: argparse.Namespace) -> int:
    from varuna.profile.job import launch_profile, parse_sizes

    return launch_profile(
        ["-m", args.module, *args.target] if args.module else list(args.target),
        gpus=args.gpus,
        run_dir=args.run_dir,
        micro_batch_sizes=parse_sizes(args.micro_batch_sizes),
        repeats=args.repeats,
        hostfile=args.hostfile,
        timeout_s=args.timeout,
    )


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]  # type: ignore[no-any-return]


def _resize(args: argparse.Namespace) -> int:
    from varuna.elastic.protocol import request_resize
    from varuna.elastic.reshape import shape_for_gpus
    from varuna.launch.slurm import check_resize

    how = ""
    if args.gpus is not None:
        if args.pipeline is not None or args.data is not None:
            raise ConfigError("give either --gpus N or --pipeline P --data D, not both")
        check_resize(args.run_dir, args.gpus, what=f"--gpus {args.gpus}")  # before the planner runs
        choice = shape_for_gpus(args.run_dir, args.gpus)
        pipeline, data, how = choice.shape.pipeline, choice.shape.data, f", chosen by the {choice.reason}"
    elif args.pipeline is None or args.data is None:
        raise ConfigError("resize needs --pipeline P --data D, or --gpus N")
    else:
        pipeline, data = args.pipeline, args.data
    check_resize(args.run_dir, pipeline * data, what=f"pipeline {pipeline} x data {data}")
    path = request_resize(args.run_dir, pipeline=pipeline, data=data, notify=not args.no_signal)
    print(f"varuna: requested {pipeline}x{data} for {args.run_dir} ({path.name}){how}")
    return 0


def _hosts(args: argparse.Namespace) -> int:
    from varuna.elastic.agent import read_state
    from varuna.elastic.hostset import edit_hostfile, parse_host, watched_hostfile

    path = watched_hostfile(args.run_dir)
    if args.action == "list":
        if args.hosts:
            raise ConfigError(f"`varuna hosts RUN_DIR list` takes no hosts, got {' '.join(args.hosts)}")
        live = (read_state(args.run_dir) or {}).get("hosts") or {}
        print(f"watched hostfile: {path}")
        for key in ("listed", "available", "offered"):
            hosts = live.get(key) or {}
            print(f"{key:>9}: {' '.join(f'{h}:{n}' for h, n in hosts.items()) or '-'}")
        print(f"{'dead':>9}: {' '.join(live.get('dead') or []) or '-'}")
        if live.get("morph_asked"):
            print(f"{'morphing':>9}: {live['morph_asked']}")
        return 0
    if not args.hosts:
        raise ConfigError(f"`varuna hosts RUN_DIR {args.action}` needs at least one HOST[:SLOTS]")
    if args.action == "add":
        add = dict(parse_host(h) for h in args.hosts)
        after = edit_hostfile(path, add={h: n or 1 for h, n in add.items()})
    else:
        after = edit_hostfile(path, remove=[parse_host(h, default_slots=None)[0] for h in args.hosts])
    listed = " ".join(f"{h}:{n}" for h, n in after.items()) or "no host"
    print(f"varuna: {path} now lists {listed}; the job follows at the end of a step")
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
    from varuna.launch.job import run_job

    if args.module is not None:
        script_argv = ["-m", args.module, *args.target]
    elif args.target:
        script_argv = list(args.target)
    else:
        raise ConfigError(f"nothing to run: give a script or -m MODULE ({EXAMPLE})")
    if args.watch_hosts:
        if not args.elastic or args.hostfile is None:
            raise ConfigError("--watch-hosts needs --elastic and --hostfile FILE (the hostfile to follow)")
        from varuna.elastic.agent import run_foreground

        return run_foreground(
            script_argv,
            pipeline=args.pipeline,
            data=args.data,
            run_dir=args.run_dir,
            hostfile=args.hostfile,
            max_restarts=args.max_restarts,
            timeout_s=args.timeout,
            settle_s=args.settle,
            placement=args.placement,
        )
    if args.elastic:
        from varuna.elastic.supervisor import run_elastic

        return run_elastic(
            script_argv,
            pipeline=args.pipeline,
            data=args.data,
            run_dir=args.run_dir,
            hostfile=args.hostfile,
            max_restarts=args.max_restarts,
            timeout_s=args.timeout,
            placement=args.placement,
        )
    return run_job(
        script_argv,
        pipeline=args.pipeline,
        data=args.data,
        run_dir=args.run_dir,
        hostfile=args.hostfile,
        timeout_s=args.timeout,
        placement=args.placement,
    )


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code."""
    parser, run = _parsers()
    argv = list(sys.argv[1:] if argv is None else argv)
    head, target = _split_target(argv, run) if argv[:1] == ["run"] else (argv, [])
    if argv[:1] == ["profile"]:
        head, target = _split_target(argv, _subcommand(parser, "profile"))
    args = parser.parse_args(head)
    if args.command in ("run", "profile"):
        args.target = target
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "profile":
            return _profile(args)
        if args.command == "resize":
            return _resize(args)
        if args.command == "notice":
            return _notice(args)
        if args.command == "hosts":
            return _hosts(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "consolidate":
            return _consolidate(args)
        parser.error(f"unknown command {args.command!r}")
    except (ConfigError, LaunchError, CheckpointError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        print(f"varuna: error: {'; '.join(lines)}", file=sys.stderr)  # one line, for scripts and people
        return 2
    return 2
