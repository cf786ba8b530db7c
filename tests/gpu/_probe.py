"""The `nccl-probe` check: one short 2-rank job per point-to-point pattern (`_probe_worker.CASES`),
and, on NCCL, the same failing patterns again under NCCL settings that change its transport.

A GPU run has little device time, and a pipeline job that hangs only says that it hung. Here each
case has its own short timeout, so a hung case costs only that and the others still answer; the
failed case's log holds every rank's Python stack at its timeout (the launcher asks for them). If
a case fails on NCCL, the failing cases run again with `NCCL_P2P_DISABLE=1` (no CUDA IPC between
the ranks' buffers), then with `NCCL_SHM_DISABLE=1` too (sockets): the first setting under which
they all pass is kept for the later checks (`Context.nccl_env`) and named in the report. If none
does, the later jobs that would talk point-to-point over NCCL are reported as not run, with the
reason, instead of each hanging until its own timeout.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from _harness import Context, Transport, check_record, fallback, launch, transport
from _probe_worker import CASES

TIMEOUT_S = 20.0
VARIANTS: tuple[tuple[str, dict[str, str]], ...] = (
    ("NCCL_P2P_DISABLE=1", {"NCCL_P2P_DISABLE": "1"}),
    ("NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}),
)


def run_probe(ctx: Context) -> dict[str, Any]:
    name = "nccl-probe"
    if ctx.left_s() < 20:
        return check_record(
            name, "not run", 0.0, details={"reason": f"under 20 s of the {ctx.budget_s:g} s budget left"}
        )
    t0 = time.perf_counter()
    via = transport(ctx, 2)
    cases: dict[str, Any] = {}
    for case in CASES:
        cases[case], via = _case(ctx, case, via, "")
    failing = [c for c, r in cases.items() if not r["ok"]]
    details: dict[str, Any] = {
        "problems": [f"{c}: {cases[c].get('exit') or cases[c].get('problems')}" for c in failing],
        "cases": cases,
    }
    if failing and via.cuda:
        details["variants"] = variants = {}
        for n, (label, extra) in enumerate(VARIANTS, 1):
            tried = Transport(f"{via.label}, {label}", {**via.env, **extra}, cuda=True)
            variants[label] = got = {}
            for case in failing:
                got[case], _ = _case(ctx, case, tried, f"-setting{n}")
                if not got[case]["ok"]:
                    break  # the rest would fail the same way; keep the device time
            if len(got) == len(failing) and all(r["ok"] for r in got.values()):
                ctx.nccl_env = extra
                details["kept"] = label
                break
        if ctx.nccl_env is None:
            tried = [v for v, _ in VARIANTS]
            for case, field, what in (
                ("serial", "p2p_hangs", "the engine's links"),
                ("link", "early_hangs", "P2P's early receives"),
            ):
                if case in failing:
                    why = f"nccl-probe's {case} case failed on NCCL, also under {tried}: a job over {what} would hang the same"
                    setattr(ctx, field, why)
    status = "failed" if failing else "passed"
    return check_record(
        name, status, time.perf_counter() - t0, transport=via.label, cuda=via.cuda, details=details
    )


def _case(ctx: Context, case: str, via: Transport, suffix: str) -> tuple[dict[str, Any], Transport]:
    """One case as one job (on gloo instead if NCCL refuses ranks sharing a GPU); its result and the
    transport it ended on."""
    if ctx.left_s() < 20:
        return {"ok": False, "status": "not run"}, via
    tag = f"nccl-probe-{case}{suffix}"
    out = ctx.work / tag
    out.mkdir()
    done = launch(
        ctx, tag, "_probe_worker.py", [str(out), case], pipeline=2, data=1, via=via, timeout_s=TIMEOUT_S
    )
    refusal = done.refusal() if "NCCL_MULTI_RANK_GPU_ENABLE" in via.env else None
    if refusal is not None:
        ctx.nccl_refused, via = refusal, fallback()
        done = launch(
            ctx,
            tag + "-gloo",
            "_probe_worker.py",
            [str(out), case],
            pipeline=2,
            data=1,
            via=via,
            timeout_s=TIMEOUT_S,
        )
    if done.code != 0:
        return {"ok": False, "status": "failed", "exit": done.code, "log_tail": done.tail(2500)}, via
    return judge(out, case), via


def judge(out: Path, case: str) -> dict[str, Any]:
    """Each rank saw exactly the values sent: rank 1 the activations, rank 0 twice them back."""
    steps = [10.0 * s + m for s in range(2) for m in range(3)]
    sent = {"one-group": [1.0], "link": steps, "serial": steps}.get(case, [1.0, 2.0, 3.0])
    ranks = [json.loads((out / f"probe-rank{r}.json").read_text()) for r in (0, 1)]
    want = [[2 * v for v in sent], sent]
    problems = [
        f"rank {r} saw {ranks[r]['seen']}, expected {want[r]}" for r in (0, 1) if ranks[r]["seen"] != want[r]
    ]
    return {
        "ok": not problems,
        "status": "passed" if not problems else "failed",
        "problems": problems,
        "seconds": max(r["seconds"] for r in ranks),
    }
