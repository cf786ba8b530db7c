"""What `run_gpu_checks.py` builds on: the environment it reports, the transport each job gets, one
launch of a worker through `varuna.launch.job.Job`, and the comparison with plain training.

Transport. The engine's device follows the backend (NCCL: the rank's GPU; gloo: the CPU), and
`varuna.comm.rendezvous` gives the ranks of a host its GPUs round-robin. A job of W ranks on G < W
GPUs puts two ranks on one GPU, which NCCL 2.5 to 2.29 refuses ("Duplicate GPU detected");
NCCL 2.30 accepts it, experimentally, with NCCL_MULTI_RANK_GPU_ENABLE=1 (torch loads the NCCL of
the nvidia-nccl-cuXX wheel of its CUDA, so `pip install -U "nvidia-nccl-cu13>=2.30"` provides it for
a CUDA 13 build, or `make gpu-check NCCL_LIB=...` preloads one). So with an
NCCL of 2.30 or later a job on a GPU host runs on NCCL, that variable set when GPUs are shared; with
an older one, or if NCCL refuses all the same, the job runs on gloo, which computes on the CPU, and
the check says so (`cuda: false`): what then ran on the GPU is only the one-rank job. Nothing here changes `varuna`: a gloo job with CUDA tensors would need the
engine's device seam to accept gloo on CUDA, which the CPU-first engine does not do.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
REFUSAL_MARKS = ("Duplicate GPU detected", "Duplicated GPU device", "ncclInvalidUsage")
"""Lines by which NCCL says it will not put two ranks on one GPU."""

sys.path.insert(0, str(REPO / "tests" / "scripts"))
from transparency_common import GLOBAL_BATCH, build, dataset, optimizer  # noqa: E402

from varuna.data import collate, global_indices  # noqa: E402


@dataclass(slots=True)
class Transport:
    """How one job's ranks talk: the environment it adds and what the report says of it."""

    label: str
    env: dict[str, str]
    cuda: bool
    """Whether the ranks compute on a GPU."""


@dataclass(slots=True)
class Context:
    """One run of the checks: the device asked for, the deadline, and what NCCL refused so far."""

    device: str
    quick: bool
    work: Path
    deadline: float
    budget_s: float
    rtol: float
    gpus: int = 0
    nccl_refused: str | None = None
    """NCCL's refusal line, once a job with ranks sharing a GPU has seen it (later jobs skip NCCL)."""
    nccl_env: dict[str, str] | None = None
    """NCCL settings the probe found point-to-point to need here (added to every NCCL job)."""
    p2p_hangs: str | None = None
    """Why the engine's links on NCCL (`varuna.comm.serial`) would hang here: the probe's `serial`
    case failed under every setting tried."""
    early_hangs: str | None = None
    """Why `P2P`'s early receives (the p2p check; the engine's links on gloo) would hang here: the
    probe's `link` case failed under every setting tried."""
    logs: list[Path] = field(default_factory=list)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def environment(device: str) -> dict[str, Any]:
    """torch, CUDA, NCCL, the GPUs and the MPI the jobs run under."""
    from varuna.launch.job import find_mpiexec, mpi_flavor

    env: dict[str, Any] = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "host": socket.gethostname(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    try:
        mpiexec = find_mpiexec()
        env["mpi"] = mpi_flavor(str(mpiexec))
    except Exception as exc:  # noqa: BLE001 - reported; the jobs will fail with the launcher's own error
        env["mpi"] = f"none: {exc}"
    try:
        env["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.TimeoutExpired):
        env["commit"] = None
    if device == "cuda":
        env["gpus"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
            }
            for i in range(torch.cuda.device_count())
        ]
        env["nccl"] = ".".join(map(str, nccl_version()))
        env["cudnn"] = torch.backends.cudnn.version()
        env["visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return env


def nccl_version() -> tuple[int, int, int]:
    """The NCCL this process runs: ncclGetVersion of the loaded libnccl (torch's
    `torch.cuda.nccl.version()` gives the version torch was built against, which an NCCL installed
    or preloaded beside it does not change); torch's when the library cannot be asked."""
    v = _loaded_nccl_code()
    if v is None:
        t = torch.cuda.nccl.version()
        if isinstance(t, tuple):
            return (int(t[0]), int(t[1]), int(t[2]))
        v = int(t)
    return (v // 10000, v // 100 % 100, v % 100) if v >= 20900 else (v // 1000, v // 100 % 10, v % 100)


def _loaded_nccl_code() -> int | None:
    try:
        lib = ctypes.CDLL("libnccl.so.2")  # the copy torch loaded (or LD_PRELOAD put first)
        code = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return code.value


def shared_gpu_refusal() -> str | None:
    """Why NCCL will not put two ranks on one GPU here, known before trying; None if it may."""
    v = nccl_version()
    if v >= (2, 30, 0):
        return None
    return (
        f"NCCL {'.'.join(map(str, v))} refuses two ranks on one GPU; 2.30+ accepts them with "
        f'NCCL_MULTI_RANK_GPU_ENABLE=1 (pip install -U "{nccl_wheel()}>=2.30", or make gpu-check '
        "NCCL_LIB=/path/to/a/newer/libnccl.so.2)"
    )


def nccl_wheel() -> str:
    """The NCCL wheel of this torch's CUDA (nvidia-nccl-cu12 for CUDA 12 builds, -cu13 for 13)."""
    return f"nvidia-nccl-cu{(torch.version.cuda or '12').split('.')[0]}"


def transport(ctx: Context, world: int) -> Transport:
    """The transport a job of `world` ranks gets (see the module docstring)."""
    if ctx.device == "cpu":
        return Transport("gloo (cpu) under NCCL's rules", {**_GLOO, "VARUNA_NCCL_RULES": "1"}, cuda=False)
    extra = ctx.nccl_env or {}
    said = "".join(f", {k}={v}" for k, v in extra.items())
    if world <= ctx.gpus:
        return Transport(f"nccl, one GPU per rank{said}", {"VARUNA_BACKEND": "nccl", **extra}, cuda=True)
    if ctx.nccl_refused is None:
        per = math.ceil(world / ctx.gpus)
        return Transport(
            f"nccl, {per} ranks per GPU (NCCL_MULTI_RANK_GPU_ENABLE=1{said})",
            {"VARUNA_BACKEND": "nccl", "NCCL_MULTI_RANK_GPU_ENABLE": "1", **extra},
            cuda=True,
        )
    return fallback()


def check_record(name: str, status: str, seconds: float, **rest: Any) -> dict[str, Any]:
    """One check's entry in the report."""
    return {"name": name, "ok": status == "passed", "status": status, "seconds": round(seconds, 2), **rest}


_GLOO = {"VARUNA_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": ""}


def fallback() -> Transport:
    """gloo on the CPU, under NCCL's point-to-point rules (`varuna.comm.nccl_rules`)."""
    return Transport(
        "gloo (cpu) under NCCL's rules - fallback: NCCL puts no two ranks on one GPU here",
        {**_GLOO, "VARUNA_NCCL_RULES": "1"},
        cuda=False,
    )


@dataclass(slots=True)
class Launched:
    code: int | str
    seconds: float
    log: Path

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def refusal(self) -> str | None:
        """NCCL's line refusing ranks that share a GPU, if the job died of that."""
        if self.code == 0 or not self.log.exists():
            return None
        for line in self.log.read_text(errors="replace").splitlines():
            if any(mark in line for mark in REFUSAL_MARKS):
                return line.strip()[-300:]
        return None


def launch(
    ctx: Context,
    name: str,
    worker: str,
    args: list[str],
    *,
    pipeline: int,
    data: int,
    via: Transport,
    timeout_s: float,
) -> Launched:
    """Run tests/gpu/`worker` on pipeline x data ranks with `varuna.launch.job.Job`, to the end or
    for `timeout_s` (capped by the run's deadline); its output goes to a log in the work folder."""
    from varuna.launch.job import Job

    log = ctx.work / f"{name}.log"
    ctx.logs.append(log)
    timeout_s = max(1.0, min(timeout_s, ctx.left_s() - 5.0))
    path = os.environ.get("PYTHONPATH", "")
    env = {
        "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        "OMP_NUM_THREADS": "1",
        "VARUNA_TIMEOUT": os.environ.get("VARUNA_TIMEOUT", "120"),
        **via.env,
    }
    t0 = time.perf_counter()
    with open(log, "w") as out:
        job = Job(
            [str(HERE / worker), *args],
            pipeline=pipeline,
            data=data,
            run_dir=ctx.work / f"run-{name}",
            extra_env=env,
            timeout_s=timeout_s,
            grace_s=5.0,
            stdout=out,
            stderr=out,
        )
        try:
            job.start()
            code: int | str = job.wait()
        finally:
            if job.state == "running":  # interrupted: take the ranks down with us
                job.stop(signal.SIGKILL)
                job.stop(signal.SIGKILL)
                job.wait()
    if code == 124:
        code = f"timeout after {timeout_s:.0f} s"
    return Launched(code, time.perf_counter() - t0, log)


_REFERENCES: dict[tuple[str, str, int], tuple[list[float], dict[str, torch.Tensor]]] = {}


def reference(kind: str, device: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain one-process training of the transparency test's `kind` on `device` (TF32 off), as
    tests/scripts/transparency_common.reference does on the CPU; parameters returned on the CPU."""
    key = (kind, device, steps)
    if key not in _REFERENCES:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        model = build(kind).to(device)
        data = dataset(kind)
        opt = optimizer(model.parameters())
        losses = []
        for k in range(steps):
            batch = collate([data[i] for i in global_indices(k, GLOBAL_BATCH, len(data))])
            loss = model(**{n: v.to(device) for n, v in batch.items()})
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        _REFERENCES[key] = losses, {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return _REFERENCES[key]


def compare(folder: Path, kind: str, world: int, data: int, steps: int, rtol: float) -> dict[str, Any]:
    """One (model, P x D, schedule) run against plain training on the device its ranks used.

    Equal means the transparency test's criterion at `rtol`: every rank's losses within `rtol`
    relative, every parameter within `rtol` relative plus `rtol / 100` absolute (entries near zero),
    and every parameter held by at least D ranks. The deviations are reported either way:
    `loss_rel` the largest relative loss error, `param_rel` the largest |a - b| / max|b| of a tensor.
    """
    files = sorted(folder.glob("rank*.pt"))
    problems: list[str] = []
    if len(files) != world:
        return {"ok": False, "problems": [f"{len(files)} rank results, expected {world}"]}
    results = [torch.load(f, weights_only=True) for f in files]
    ref_losses, ref_params = reference(kind, results[0]["device"].split(":")[0], steps)
    ref_l = torch.tensor(ref_losses, dtype=torch.float64)
    loss_rel = param_rel = 0.0
    seen: dict[str, int] = {}
    for r in results:
        if len(r["losses"]) != steps:
            return {"ok": False, "problems": [f"{len(r['losses'])} losses, expected {steps}"]}
        got = torch.tensor(r["losses"], dtype=torch.float64)
        loss_rel = max(loss_rel, float(((got - ref_l).abs() / ref_l.abs()).max()))
        for name, value in r["params"].items():
            want = ref_params[name]
            seen[name] = seen.get(name, 0) + 1
            scale = float(want.abs().max()) or 1.0
            param_rel = max(param_rel, float((value - want).abs().max()) / scale)
            if not torch.allclose(value, want, rtol=rtol, atol=rtol / 100):
                problems.append(f"{name} differs (max |a-b| {float((value - want).abs().max()):.3g})")
    if loss_rel > rtol:
        problems.append(f"losses differ by {loss_rel:.3g} relative")
    missing = sorted(n for n in ref_params if seen.get(n, 0) < data)
    if missing:
        problems.append(f"held by fewer than {data} ranks: {missing}")
    return {"ok": not problems, "loss_rel": loss_rel, "param_rel": param_rel, "problems": problems[:5]}
