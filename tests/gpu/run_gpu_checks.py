"""The GPU readiness checks: real `varuna run` jobs on NCCL, one JSON report, under 8 minutes.

    python tests/gpu/run_gpu_checks.py --out report.json            # on a CUDA host
    python tests/gpu/run_gpu_checks.py --device cpu --out report.json   # the same jobs on gloo

Checks, in order, each one job with its own timeout inside the run's budget (`--budget-s`):

    nccl-probe      2 ranks, one short job per point-to-point pattern the pipeline rests on (one
                    group; a group per direction; a receive on one in flight while sending on the
                    other; the P2P link itself), so a hang names its pattern (tests/gpu/_probe_worker.py)
    p2p             2 ranks: `varuna.comm.p2p` delivers every activation and gradient exactly and
                    in order (shape changes, tuples, a 4 MiB tensor; NCCL pairs by posting order),
                    and an arrival is seen without waiting for it (tests/gpu/_p2p_worker.py)
    equality-PxD    every schedule in `varuna.schedule.SCHEDULES`, GPT and BERT, at 1x1, 2x1, 2x2,
                    equal to plain training on the same device (tests/gpu/_equality_worker.py)
    bench-2x1       samples/s of every schedule at P = 2 and its share of the bubble-limited
                    ideal against one process (tests/gpu/_bench_worker.py); reported, never judged

The report holds, per check: name, ok, status (passed, failed, or not run: the budget was spent), seconds, the transport the ranks
used, whether they computed on a GPU, and the figures; plus the environment (torch, CUDA, NCCL, GPU
names). With fewer GPUs than ranks the ranks share GPUs; see tests/gpu/_harness.py for what happens
when NCCL refuses that. The exit status is 0 when every check passed.

Equality is checked to `--rtol` (the CPU transparency test's 1e-5 on CPU; 1e-4 on CUDA by default,
where kernels choose their reduction order by shape: a micro-batch of 2 and the reference's batch of
16 sum in different orders); the largest deviations are reported either way, so a run shows
whether 1e-5 holds there too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
from _harness import (  # noqa: E402
    Context,
    Launched,
    Transport,
    check_record,
    compare,
    environment,
    fallback,
    launch,
    shared_gpu_refusal,
    transport,
)
from _p2p_worker import MICRO as P2P_MICRO  # noqa: E402
from _p2p_worker import STEPS as P2P_STEPS  # noqa: E402
from _probe import run_probe  # noqa: E402

from varuna.errors import ConfigError  # noqa: E402
from varuna.schedule import SCHEDULES, schedule_spec  # noqa: E402

BUDGET_S = 480.0
MODELS = ("gpt", "bert")
Judge = Callable[[Path], dict[str, Any]]


def run_phase(
    ctx: Context,
    name: str,
    worker: str,
    args: list[str],
    pipeline: int,
    data: int,
    timeout_s: float,
    judge: Judge,
    *,
    env: dict[str, str] | None = None,
    early: bool = False,
) -> dict[str, Any]:
    """One check: launch its job (rerun on gloo if NCCL refuses ranks sharing a GPU), then judge
    the files it wrote. `env`: added to the job's; `early`: the job talks through `P2P`'s early
    receives (the p2p check), not the engine's serial links on NCCL."""
    if ctx.left_s() < 20:
        return check_record(
            name, "not run", 0.0, details={"reason": f"under 20 s of the {ctx.budget_s:g} s budget left"}
        )
    via = transport(ctx, pipeline * data)
    hangs = ctx.early_hangs if early else ctx.p2p_hangs
    if hangs and via.cuda and pipeline > 1:
        return check_record(name, "not run", 0.0, transport=via.label, cuda=True, details={"reason": hangs})
    if env:
        via = Transport(via.label, {**via.env, **env}, cuda=via.cuda)
    out = ctx.work / name
    out.mkdir()
    details: dict[str, Any] = {}
    t0 = time.perf_counter()
    done: Launched = launch(
        ctx, name, worker, [str(out), *args], pipeline=pipeline, data=data, via=via, timeout_s=timeout_s
    )
    refusal = done.refusal() if "NCCL_MULTI_RANK_GPU_ENABLE" in via.env else None
    if refusal is not None:
        ctx.nccl_refused = details["nccl_refused"] = refusal
        shutil.rmtree(out)
        out.mkdir()
        via = fallback()
        if env:
            via = Transport(via.label, {**via.env, **env}, cuda=via.cuda)
        done = launch(
            ctx,
            name + "-gloo",
            worker,
            [str(out), *args],
            pipeline=pipeline,
            data=data,
            via=via,
            timeout_s=timeout_s,
        )
    seconds = time.perf_counter() - t0
    where = {"transport": via.label, "cuda": via.cuda}
    if done.code != 0:
        details |= {"exit": done.code, "log_tail": done.tail()}
        return check_record(name, "failed", seconds, **where, details=details)
    try:
        details |= judge(out)
    except Exception as exc:  # noqa: BLE001 - a broken result file fails this check, not the run
        details |= {"ok": False, "problems": [f"{type(exc).__name__}: {exc}"]}
    status = "passed" if details.pop("ok") else "failed"
    return check_record(name, status, seconds, **where, details=details)


def judge_p2p(out: Path) -> dict[str, Any]:
    ranks = [json.loads((out / f"p2p-rank{r}.json").read_text()) for r in (0, 1)]
    want_early = P2P_STEPS * P2P_MICRO - P2P_MICRO - 2  # none at step 0, two shape changes
    problems = []
    for mode, result in ranks[1]["ordering"].items():
        wrong = ranks[0]["ordering"][mode]["wrong"] + result["wrong"]
        if wrong:
            problems.append(f"{mode}: wrong {wrong[:4]}")
        if result["early"] != want_early:
            problems.append(f"{mode}: {result['early']} early receives used, expected {want_early}")
    for r, seen in enumerate(ranks):
        a = seen["arrival"]
        if a["ready_at_once"] or a["after_s"] is None or a["after_s"] < 0.1 or not a["exact"]:
            problems.append(f"rank {r} arrival: {a}")
    return {
        "ok": not problems,
        "problems": problems,
        "backend": ranks[0]["backend"],
        "devices": [r["device"] for r in ranks],
        "modes": sorted(ranks[1]["ordering"]),
        "early_receives": {m: r["early"] for m, r in ranks[1]["ordering"].items()},
        "arrival_seen_after_s": [round(r["arrival"]["after_s"] or -1, 4) for r in ranks],
    }


def judge_equality(pipeline: int, data: int, steps: int, rtol: float, schedules: Sequence[str]) -> Judge:
    def judge(out: Path) -> dict[str, Any]:
        runs = {}
        for kind in MODELS:
            for schedule in schedules:
                tag = f"{kind}-{pipeline}x{data}-{schedule}"
                runs[tag] = compare(out / tag, kind, pipeline * data, data, steps, rtol)
        failing = [t for t, r in runs.items() if not r["ok"]]
        ran = [r for r in runs.values() if "loss_rel" in r]
        return {
            "ok": not failing,
            "rtol": rtol,
            "steps": steps,
            "schedules": list(schedules),
            "max_loss_rel": max((r["loss_rel"] for r in ran), default=None),
            "max_param_rel": max((r["param_rel"] for r in ran), default=None),
            "failing": failing,
            "runs": runs,
        }

    return judge


def judge_bench(out: Path) -> dict[str, Any]:
    report = json.loads((out / "bench.json").read_text())
    rows = report["schedules"]
    finite = all(all(map(_finite, r["losses"])) for r in rows.values())
    missing = [s for s in report.get("asked", SCHEDULES) if s not in rows]
    return {
        "ok": finite and not missing,  # a bench reports; it fails only if a schedule did not train
        "problems": ([] if finite else ["a loss is not finite"]) + [f"{s} missing" for s in missing],
        **{k: report[k] for k in ("pipeline", "global_batch_size", "micro_batch_size", "warmup", "steps")},
        "model": {k: report["model"][k] for k in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head")},
        "single_samples_per_s": round(report["single_samples_per_s"], 1),
        "schedules": {
            s: {
                "median_step_ms": round(1e3 * r["median_step_s"], 2),
                "samples_per_s": round(r["samples_per_s"], 1),
                "share_of_ideal": round(r["share_of_ideal"], 3),
                "peak_mib_per_rank": [
                    None if b is None else round(b / 2**20, 1) for b in r["peak_bytes_per_rank"]
                ],
            }
            for s, r in rows.items()
        },
    }


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _summary(check: dict[str, Any]) -> str:
    d = check.get("details", {})
    if check["status"] != "passed":
        return str(d.get("problems") or d.get("exit") or d.get("reason", ""))[:200]
    if "cases" in d:
        return ", ".join(f"{c} {r['status']}" for c, r in d["cases"].items())
    if "early_receives" in d:
        return f"early receives {d['early_receives']}, arrivals seen after {d['arrival_seen_after_s']} s"
    if "max_loss_rel" in d:
        return (
            f"{len(d['runs'])} runs, max loss rel {d['max_loss_rel'] or 0:.2g}, "
            f"max param rel {d['max_param_rel'] or 0:.2g}"
        )
    if "schedules" in d:
        return ", ".join(
            f"{s} {r['samples_per_s']}/s ({r['share_of_ideal']:.2f})" for s, r in d["schedules"].items()
        )
    return ""


def run(device: str, *, quick: bool, budget_s: float, rtol: float | None, work: Path) -> dict[str, Any]:
    """Every check on `device` ("cuda" or "cpu"); the report."""
    t0 = time.monotonic()
    rtol = rtol if rtol is not None else (1e-5 if device == "cpu" else 1e-4)
    ctx = Context(device=device, quick=quick, work=work, deadline=t0 + budget_s, budget_s=budget_s, rtol=rtol)
    if device == "cuda":
        ctx.gpus = torch.cuda.device_count()
        if ctx.gpus < 4:  # 2x2 shares GPUs
            ctx.nccl_refused = shared_gpu_refusal()
    steps = 3 if quick else 5
    size, warmup, timed = (
        ("tiny", 1, 2) if quick else (("bench", 3, 10) if device == "cuda" else ("bench", 1, 3))
    )
    checks = [run_probe(ctx), run_phase(ctx, "p2p", "_p2p_worker.py", [], 2, 1, 120, judge_p2p, early=True)]
    one = [s for s in SCHEDULES if schedule_spec(s).chunks_per_rank == 1]
    chunked = [s for s in SCHEDULES if s not in one]
    phases = [("equality-1x1", 1, 1, list(SCHEDULES))]
    for P, D in ((2, 1), (2, 2)):
        # two chunks per rank in their own job (their messages cross in a table of ticks, several
        # boundaries per rank pair: `varuna.comm._ticks`), so that one failing leaves the others'
        phases += [(f"equality-{P}x{D}", P, D, one), (f"equality-{P}x{D}-chunks", P, D, chunked)]
    for name, P, D, schedules in phases:
        judge = judge_equality(P, D, steps, rtol, schedules)
        env = {"EQUALITY_SCHEDULES": ",".join(schedules)}
        checks.append(run_phase(ctx, name, "_equality_worker.py", [str(steps)], P, D, 150, judge, env=env))
    bench_args = [size, str(warmup), str(timed)]
    checks.append(
        run_phase(
            ctx,
            "bench-2x1",
            "_bench_worker.py",
            bench_args,
            2,
            1,
            240,
            judge_bench,
            env={"BENCH_SCHEDULES": ",".join(SCHEDULES)},
        )
    )
    for c in checks:
        print(
            f"{c['name']:<14} {c['status']:<7} {c['seconds']:>6.1f} s  {c.get('transport', '')}: {_summary(c)}",
            file=sys.stderr,
        )
    return {
        "ok": all(c["ok"] for c in checks),
        "device": device,
        "quick": quick,
        "seconds": round(time.monotonic() - t0, 1),
        "budget_s": budget_s,
        "nccl_refused": ctx.nccl_refused,
        "environment": environment(device),
        "checks": checks,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="run_gpu_checks.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="auto: cuda if available"
    )
    p.add_argument("--out", type=Path, help="write the JSON report here (default: stdout)")
    p.add_argument("--quick", action="store_true", help="3 training steps, the tiny bench model")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="the whole run's time limit (seconds)")
    p.add_argument("--rtol", type=float, help="equality tolerance (default 1e-5 on cpu, 1e-4 on cuda)")
    p.add_argument("--keep", action="store_true", help="keep the jobs' folders and logs (path on stderr)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"--device cuda but torch {torch.__version__} sees no CUDA device (torch.version.cuda is "
            f"{torch.version.cuda}): run with --device cpu, or install a CUDA build of torch "
            '(make install TORCH_SPEC="torch==<version>" on the GPU host)'
        )
    if args.budget_s <= 0 or (args.rtol is not None and args.rtol <= 0):
        raise ConfigError(f"--budget-s and --rtol must be > 0 (got {args.budget_s}, {args.rtol})")
    work = Path(tempfile.mkdtemp(prefix="varuna-gpu-checks-"))
    try:
        report = run(device, quick=args.quick, budget_s=args.budget_s, rtol=args.rtol, work=work)
    finally:
        if args.keep:
            print(f"jobs' folders and logs kept in {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    else:
        print(text)
    print(f"{'ok' if report['ok'] else 'FAILED'} in {report['seconds']} s on {device}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
