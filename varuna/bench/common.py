"""What several benchmarks share beyond `varuna.bench`'s helpers.

    run_job          a `varuna run` job to completion, or a LaunchError with the end of its log
                     (the pipeline and planner benches)
    LR, SEED, ...    the training of the benches' GPT workers: the model, the batches, the learning
    build_model      rate, a log line, an all-gather (the pipeline and telemetry workers)
    global_batches
    gather
    worker_log
    run_worker       a worker's entry: its spec, one thread, a hang dumped, rank 0 writes the result

The workers' helpers import torch when called, so that a bench's parent process, which imports
this module too, stays light.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from varuna._files import write_json_atomic
from varuna.bench import ROOT, bench_env, log
from varuna.errors import LaunchError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor

    from varuna.models import GPT
    from varuna.planner.costs import SegmentCost

__all__ = [
    "run_job",
    "stop_job",
    "LR",
    "SEED",
    "DATA_SEED",
    "worker_log",
    "build_model",
    "global_batches",
    "gather",
    "run_worker",
]

LR = 1e-4
SEED = 0
DATA_SEED = 0


# ------------------------------------------------------------------------------------ the parent


def stop_job(proc: subprocess.Popen[bytes]) -> None:
    """Stop a job started in a session of its own: SIGTERM (`varuna run` stops its ranks on it),
    SIGKILL to the session if it has not ended 15 s later."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_job(name: str, cmd: list[str], timeout_s: float, log_path: Path) -> None:
    """Run one job to completion, or raise LaunchError naming `name` with the end of its output.

    The job's output goes to `log_path`; its `[bench]` lines (`worker_log`) are echoed on stderr.
    """
    t0 = time.perf_counter()
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=bench_env(60),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | str = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_job(proc)
            code = f"timeout after {timeout_s:g} s"
        except BaseException:  # the bench itself stopped (SIGTERM, Ctrl-C): so does its job
            stop_job(proc)
            raise
    text = log_path.read_text(errors="replace")
    if code != 0:
        tail = "\n".join(text.splitlines()[-40:])
        raise LaunchError(
            f"benchmark job {name} failed ({code}); its log: {log_path}; the end of it:\n{tail}"
        )
    for line in text.splitlines():
        if "[bench]" in line:
            print(line, file=sys.stderr)
    log(f"{name}: done in {time.perf_counter() - t0:.1f} s")


# ----------------------------------------------------------------------------------- the workers


def worker_log(msg: str) -> None:
    """A `[bench]` line on a worker's stderr, which `run_job` echoes."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def build_model(cfg: dict[str, Any]) -> GPT:
    """The GPT of `cfg` (keyword arguments of `GPTConfig`), seeded: the same weights on every rank."""
    import torch

    from varuna.models import GPT, GPTConfig

    torch.manual_seed(SEED)
    return GPT(GPTConfig(**cfg))


def forward_backward_s(segments: Sequence[SegmentCost], mbs: int) -> float:
    """Seconds of forward + backward of one micro-batch of size `mbs` through the whole model, from a
    profile's segments: the benches' gauge of the host's speed."""
    return sum(s.forward_s[mbs] + s.backward_s[mbs] for s in segments)


def global_batches(spec: dict[str, Any]) -> list[dict[str, Tensor]]:
    """The global batches of steps 0 .. warmup+steps-1, made before any timing starts."""
    from varuna.data import SyntheticLM, collate, global_indices

    cfg, B = spec["model"], spec["global_batch_size"]
    steps = spec["warmup"] + spec["steps"]
    ds = SyntheticLM(cfg["vocab_size"], cfg["seq_len"], max(B * steps, 1024), seed=DATA_SEED)
    return [collate([ds[i] for i in global_indices(s, B, len(ds))]) for s in range(steps)]


def gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order (an all-gather of picklable objects)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_worker(argv: list[str], run: Callable[[dict[str, Any]], Any]) -> None:
    """A bench worker's `main`: read the spec from the file `argv[0]` names, one torch thread, then
    `run(spec)`; rank 0 writes what it returned (unless None) to ``spec["out"]`` atomically. A hang
    past ``spec["hang_s"]`` becomes a traceback of every thread and exit 1 (then mpiexec ends the
    job), before the parent's own timeout has to kill anything."""
    import faulthandler
    import json

    import torch
    import torch.distributed as dist

    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(spec["hang_s"], exit=True)
    result = run(spec)
    if result is not None and dist.get_rank() == 0:
        write_json_atomic(Path(spec["out"]), result)
    faulthandler.cancel_dump_traceback_later()
