"""`varuna bench morph`: how long a resize takes, from the request to the first step in the new shape.

    python -m varuna.bench morph --json          # ~100M-parameter GPT
    python -m varuna.bench morph --quick         # tiny model: a smoke run of every path

One elastic job, started as the user would start it, resized from outside as the user would:

    varuna run --elastic -p 2 -d 1 --run-dir RUN -m varuna.bench.morph.worker SPEC.json
        ... `steps_before` steps ...
    varuna resize RUN -p 1 -d 2          <- the request (t = 0)
        the step in flight ends with the stop flag set; every rank checkpoints; exit 75
        the supervisor relaunches 1 x 2 with VARUNA_RESUME=latest; the engine loads the checkpoint
        ... `steps_after` steps; the job ends

Rank 0 of each launch logs timestamped events (see `varuna.bench.morph.worker`), with the seconds
spent in varuna.checkpoint.layout's I/O calls; the supervisor's output lines are timestamped here as
they arrive. On the run directory's filesystem, a plain sequential write of as many bytes as the
checkpoint (one file, 8 MiB chunks, then fsync, as the checkpoint's files are fsynced before the
commit) gives the rate the checkpoint is compared with, in the same page-cache state as the
checkpoint's: its pages must be new ones. On a VM that hands freed memory back to its host (a virtio
balloon with free page reporting), the first touch of a page the host took back is slow, so a write
into such pages is slower than one into pages freed a moment ago. The checkpoint's page-cache pages
are new ones: nothing freed that much memory just before it. So the plain writes wait
`plain_write_settle_s` after the job (whose exit freed gigabytes), and each keeps its file until all
are done, so that none reuses another's pages; a "warm" write right after deleting them, the rate
the checkpoint would be compared with if it reused freed pages, is reported beside it, as is a write
before the job. Then a read-back CRC-32 pass over the committed checkpoint and a one-process
dcp.save with DCP's stock writer say what verifying by reading back, and DCP's own writer, would
cost (the checkpoint computes its CRC-32s in memory while it writes). Targets (reported, never
asserted): request -> first resumed step <= 20 s; checkpoint write rate >= 50% of the plain write
rate.

This module holds the reference measurements and `run`; the settings are in
`varuna.bench.morph.config`, the job itself is started, resized and waited for in
`varuna.bench.morph.job`, and `varuna.bench.morph.report` turns its event log into the report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

from varuna.bench import log, print_report
from varuna.bench.morph.config import (
    TARGET_REQUEST_TO_STEP_S,
    TARGET_WRITE_FRACTION,
    MorphBench,
    full,
    quick,
)
from varuna.bench.morph.job import job_env, run_job
from varuna.bench.morph.report import DEFINITIONS, MB, analyse, format_table, one_event

__all__ = ["run", "main", "plain_write", "plain_writes", "crc_rate", "dcp_save_rate", "torch_import_s"]

# ------------------------------------------------------------------------------------ measurements


def plain_write(
    folder: Path, nbytes: int, chunk: int = 8 << 20, *, keep: list[Path] | None = None
) -> dict[str, float]:
    """Seconds and MB/s of writing `nbytes` random bytes to one new file in `folder`, then fsync.

    With `keep`, the file stays (its path is appended there) so that the next write cannot reuse
    its page-cache pages; the caller deletes it.
    """
    os.sync()  # start from clean page cache: the checkpoint's own writeback must not slow this one
    block = memoryview(os.urandom(chunk))
    fd, name = tempfile.mkstemp(prefix=".plain-write-", suffix=".bin", dir=folder)
    path = Path(name)
    try:
        t0 = time.perf_counter()
        with open(fd, "wb", buffering=0) as f:
            left = nbytes
            while left > 0:
                n = min(chunk, left)
                f.write(block[:n])
                left -= n
            t1 = time.perf_counter()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
    finally:
        if keep is None:
            path.unlink(missing_ok=True)
        else:
            keep.append(path)
    return {"seconds": t2 - t0, "write_s": t1 - t0, "fsync_s": t2 - t1, "mb_s": nbytes / (t2 - t0) / MB}


def plain_writes(
    folder: Path, nbytes: int, repeats: int, settle_s: float
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """`repeats` plain writes into new pages (after `settle_s`, each file kept until the last is
    written), then one into the pages they free; see DEFINITIONS["plain_write_mb_s"]."""
    time.sleep(settle_s)
    kept: list[Path] = []
    try:
        fresh = [plain_write(folder, nbytes, keep=kept) for _ in range(repeats)]
    finally:
        for path in kept:
            path.unlink(missing_ok=True)
    return fresh, plain_write(folder, nbytes)


def crc_rate(path: Path) -> dict[str, float]:
    """Seconds and MB/s of one CRC-32 pass (4 MiB reads) over every file of checkpoint `path`."""
    total, t0 = 0, time.perf_counter()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        crc = 0
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                crc = zlib.crc32(chunk, crc)
                total += len(chunk)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": total, "mb_s": total / seconds / MB if seconds > 0 else 0.0}


def dcp_save_rate(checkpoint: Path, folder: Path) -> dict[str, float]:
    """Seconds and MB/s of this one process saving tensors of `checkpoint`'s keys and shapes with
    torch.distributed.checkpoint (its default writer: one file, fsynced) into `folder`."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from varuna.checkpoint.layout import stored_tensors

    tensors = {k: torch.ones(shape, dtype=dtype) for k, (shape, dtype) in stored_tensors(checkpoint).items()}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    out = folder / ".dcp-save"
    os.sync()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": yes
            t0 = time.perf_counter()
            dcp.save(tensors, checkpoint_id=str(out))
            seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "bytes": nbytes, "mb_s": nbytes / seconds / MB}


def torch_import_s() -> float:
    """Wall seconds of `python -c "import torch"` here: the floor of every relaunched process."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120, env=job_env())
    return time.perf_counter() - t0


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(bench: MorphBench) -> dict[str, Any]:
    """Run the morph benchmark once and return its report."""
    import torch

    from varuna.models import GPT, GPTConfig, count_parameters

    t_start = time.perf_counter()
    load_before = _load()
    with torch.device("meta"):  # counts without touching memory: the cold write below must find it cold
        params = count_parameters(GPT(GPTConfig(**bench.model)))
    tmp = Path(tempfile.mkdtemp(prefix="varuna-bench-morph-"))
    # fp32 parameters and AdamW's two moments: the checkpoint's size, give or take its metadata
    log(f"plain write of {12 * params / MB:.0f} MB before the job (memory not recently used)")
    cold = plain_write(tmp, 12 * params)
    events, lines, request = run_job(bench, tmp)
    load_after_job = _load()
    report = analyse(bench, events, lines, request)
    log(
        f"job done; {bench.plain_write_repeats} plain writes of {report['bytes'] / MB:.0f} MB in {tmp / 'run'} "
        f"after {bench.plain_write_settle_s:g} s, then one into their freed pages"
    )
    plains, warm = plain_writes(
        tmp / "run", report["bytes"], bench.plain_write_repeats, bench.plain_write_settle_s
    )
    plain = sorted(plains, key=lambda r: r["mb_s"])[len(plains) // 2]
    committed = Path(one_event(events, "checkpoint", 1)["path"])
    crc = crc_rate(committed) if committed.is_dir() else None
    one = dcp_save_rate(committed, tmp / "run") if committed.is_dir() else None
    torch_s = torch_import_s()
    shutil.rmtree(tmp, ignore_errors=True)  # kept when the job fails: its log is named in the error
    (P, D), (P2, D2) = bench.start_shape, bench.to_shape
    fraction = report["write_mb_s"] / plain["mb_s"]
    return {
        "params": params,
        **{k: report[k] for k in ("bytes", "write_s", "write_mb_s")},
        "plain_write_mb_s": round(plain["mb_s"], 1),
        "write_fraction_of_plain": round(fraction, 3),
        "plain_write_warm_mb_s": round(warm["mb_s"], 1),
        "write_fraction_of_plain_warm": round(report["write_mb_s"] / warm["mb_s"], 3),
        **{k: report[k] for k in ("relaunch_s", "load_s", "request_to_resumed_step_s")},
        "from_shape": f"{P}x{D}",
        "to_shape": f"{P2}x{D2}",
        "targets": {
            "request_to_resumed_step_s": {
                "target": f"<= {TARGET_REQUEST_TO_STEP_S:g}",
                "met": report["request_to_resumed_step_s"] <= TARGET_REQUEST_TO_STEP_S,
            },
            "write_fraction_of_plain": {
                "target": f">= {TARGET_WRITE_FRACTION:g}",
                "met": fraction >= TARGET_WRITE_FRACTION,
            },
        },
        **{k: v for k, v in report.items() if k not in ("bytes", "write_s", "write_mb_s")},
        "reference": {
            "plain_write_median": {k: round(v, 3) for k, v in plain.items()},
            "plain_write_warm": {k: round(v, 3) for k, v in warm.items()},
            "plain_write_before_job": {k: round(v, 3) for k, v in cold.items()} | {"bytes": 12 * params},
            "write_fraction_of_plain_before_job": round(report["write_mb_s"] / cold["mb_s"], 3),
            "plain_write_repeats_mb_s": [round(r["mb_s"], 1) for r in plains],
            "crc32_read_back_pass_over_checkpoint": {k: round(v, 3) for k, v in crc.items()} if crc else None,
            "dcp_save_one_process": {k: round(v, 3) for k, v in one.items()} if one else None,
            "dcp_save_one_process_fraction_of_plain": round(one["mb_s"] / plain["mb_s"], 3) if one else None,
            "python_import_torch_s": round(torch_s, 3),
        },
        "model": {
            "config": bench.model,
            "params": params,
            "global_batch_size": bench.global_batch_size,
            "micro_batch_size": bench.micro_batch_size,
            "optimizer": "AdamW",
            "threads_per_rank": 1,
            "host_cores": os.cpu_count() or 1,
            "torch_version": torch.__version__,
            "load_before": load_before,
            "load_after_job": load_after_job,
            "load_after": _load(),
        },
        "definitions": DEFINITIONS,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench morph`; `args` has `json` and `quick`."""
    report = run(quick() if args.quick else full())
    return print_report(report, format_table(report), args.json)
