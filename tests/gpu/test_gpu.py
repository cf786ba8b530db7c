"""tests/gpu/run_gpu_checks.py: the full run on a CUDA host (skipped without one), its quick run on
CPU (gloo), and its typed errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import REPO

from varuna.errors import ConfigError
from varuna.schedule import SCHEDULES

SCRIPT = REPO / "tests" / "gpu" / "run_gpu_checks.py"
NAMES = [
    "nccl-probe",
    "p2p",
    "equality-1x1",
    "equality-2x1",
    "equality-2x1-chunks",
    "equality-2x2",
    "equality-2x2-chunks",
    "bench-2x1",
]
sys.path.insert(0, str(SCRIPT.parent))


def _run(tmp_path: Path, *flags: str, timeout: float) -> dict:
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *flags],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    failed = {c["name"]: c["details"] for c in report["checks"] if c["status"] != "passed"}
    assert proc.returncode == 0 and report["ok"], (failed, proc.stderr[-3000:])
    assert [c["name"] for c in report["checks"]] == NAMES
    for check in report["checks"]:
        if check["name"].startswith("equality"):  # every schedule, both models, equal
            assert len(check["details"]["runs"]) == 2 * len(check["details"]["schedules"])
        if check["name"] == "bench-2x1":
            assert set(check["details"]["schedules"]) == set(SCHEDULES)
    ran = [
        s for c in report["checks"] if c["name"].startswith("equality-2x1") for s in c["details"]["schedules"]
    ]
    assert sorted(ran) == sorted(SCHEDULES)  # the one-chunk job and the two-chunk job: every schedule
    return report


@pytest.mark.requires_cuda
@pytest.mark.multirank
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the NCCL checks)")
@pytest.mark.timeout(600)
def test_the_nccl_checks_pass_on_this_gpu_host(tmp_path: Path) -> None:
    report = _run(tmp_path, "--device", "cuda", timeout=560)
    env = report["environment"]
    assert env["gpus"] and env["nccl"]
    assert report["seconds"] < 480
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["equality-1x1"]["cuda"] is True  # one rank: on the GPU whatever NCCL allows
    # ranks sharing a GPU ran on NCCL, or on gloo only after NCCL said it refuses them
    for c in checks.values():
        assert c["cuda"] or (report["nccl_refused"] and "fallback" in c["transport"]), c


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_the_quick_run_passes_on_cpu(tmp_path: Path) -> None:
    report = _run(tmp_path, "--device", "cpu", "--quick", timeout=280)
    assert report["environment"]["device"] == "cpu"
    for check in report["checks"]:
        assert check["transport"] == "gloo (cpu) under NCCL's rules" and check["cuda"] is False
    p2p = next(c for c in report["checks"] if c["name"] == "p2p")["details"]
    assert p2p["early_receives"] == {"runtime": 14, "posting order": 14}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host accepts --device cuda")
def test_asking_for_cuda_without_it_names_the_fix() -> None:
    import run_gpu_checks

    with pytest.raises(ConfigError, match=r"--device cuda but torch .* sees no CUDA device.*--device cpu"):
        run_gpu_checks.main(["--device", "cuda"])


def test_a_non_positive_budget_or_tolerance_is_refused() -> None:
    import run_gpu_checks

    with pytest.raises(ConfigError, match=r"--budget-s and --rtol must be > 0 \(got 0.0, None\)"):
        run_gpu_checks.main(["--device", "cpu", "--budget-s", "0"])
    with pytest.raises(ConfigError, match=r"got 480.0, -1.0"):
        run_gpu_checks.main(["--device", "cpu", "--rtol", "-1"])


@pytest.mark.parametrize(
    ("reported", "refused"),
    [
        ((2, 27, 5), "NCCL 2.27.5 refuses"),
        (22703, "NCCL 2.27.3 refuses"),
        (2708, "NCCL 2.7.8"),
        ((2, 30, 1), None),
    ],
)
def test_ranks_share_a_gpu_only_from_nccl_2_30(monkeypatch, reported, refused) -> None:
    import _harness

    monkeypatch.setattr(_harness, "_loaded_nccl_code", lambda: None)  # a CUDA host would ask its library
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: reported)
    why = _harness.shared_gpu_refusal()
    wheel = f"nvidia-nccl-cu{(torch.version.cuda or '12').split('.')[0]}>=2.30"
    assert why is None if refused is None else (refused in why and wheel in why and "NCCL_LIB=" in why)


def test_each_job_gets_nccl_a_shared_gpu_or_the_gloo_fallback(tmp_path: Path) -> None:
    from _harness import Context, transport

    ctx = Context(device="cpu", quick=True, work=tmp_path, deadline=0.0, budget_s=1.0, rtol=1e-5)
    cpu = {"VARUNA_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": "", "VARUNA_NCCL_RULES": "1"}
    assert transport(ctx, 4).env == cpu
    ctx.device, ctx.gpus = "cuda", 2
    assert transport(ctx, 2).env == {"VARUNA_BACKEND": "nccl"} and transport(ctx, 2).cuda
    shared = transport(ctx, 4)
    assert shared.env["NCCL_MULTI_RANK_GPU_ENABLE"] == "1" and "2 ranks per GPU" in shared.label
    ctx.nccl_refused = "NCCL 2.27.5 refuses two ranks on one GPU"
    assert transport(ctx, 2).cuda  # a GPU each: NCCL still
    late = transport(ctx, 4)
    assert not late.cuda and "fallback" in late.label and late.env == cpu


@pytest.mark.parametrize("p2p_disable_helps", [True, False])
def test_the_probe_keeps_the_nccl_setting_that_unhangs_point_to_point_or_skips_what_would_hang(
    tmp_path: Path, monkeypatch, p2p_disable_helps: bool
) -> None:
    """The decisions the probe makes on a GPU host, with the jobs' outcomes given (the jobs themselves
    run in the quick CPU run above and on a GPU): failing cases rerun under NCCL settings, the first
    setting that passes them all is kept for every later NCCL job; with none, the later
    point-to-point jobs are reported not run instead of hanging one after another."""
    import time

    import _probe
    import run_gpu_checks
    from _harness import Context, Launched, transport

    ctx = Context(
        device="cuda", quick=True, work=tmp_path, deadline=time.monotonic() + 600, budget_s=600, rtol=1e-4
    )
    ctx.gpus = 1
    ran: list[tuple[str, str]] = []

    def launch(ctx, tag, worker, args, *, pipeline, data, via, timeout_s):  # noqa: ANN001, ANN202
        case = args[1]
        ran.append((case, via.label))
        works = case == "one-group" or (p2p_disable_helps and via.env.get("NCCL_P2P_DISABLE") == "1")
        return Launched(0 if works else "timeout after 20 s", 1.0, tmp_path / f"{tag}.log")

    monkeypatch.setattr(_probe, "launch", launch)
    monkeypatch.setattr(_probe, "judge", lambda out, case: {"ok": True, "status": "passed"})
    check = _probe.run_probe(ctx)
    assert check["status"] == "failed"  # as NCCL came, it hung: the report says so either way
    failing = [c for c in _probe.CASES if c != "one-group"]
    assert check["details"]["problems"] == [f"{c}: timeout after 20 s" for c in failing]
    variants = check["details"]["variants"]
    if p2p_disable_helps:
        assert check["details"]["kept"] == "NCCL_P2P_DISABLE=1" and list(variants) == ["NCCL_P2P_DISABLE=1"]
        assert ctx.nccl_env == {"NCCL_P2P_DISABLE": "1"} and ctx.p2p_hangs is None
        later = transport(ctx, 4)
        assert later.env["NCCL_P2P_DISABLE"] == "1" and "NCCL_P2P_DISABLE=1" in later.label
    else:  # each setting stops at its first failing case
        assert [list(v) for v in variants.values()] == [["two-groups"], ["two-groups"]]
        assert ctx.nccl_env is None and "would hang the same" in (ctx.p2p_hangs or "")
        skipped = run_gpu_checks.run_phase(
            ctx, "p2p", "_p2p_worker.py", [], 2, 1, 120, run_gpu_checks.judge_p2p
        )
        assert skipped["status"] == "not run" and skipped["details"]["reason"] == ctx.p2p_hangs
    assert len(ran) == len(_probe.CASES) + (len(failing) if p2p_disable_helps else 2)
