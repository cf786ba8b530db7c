"""`varuna bench morph`: how long a resize takes, from the request to the first step in the new shape.

    python -m varuna.bench morph --json          # ~100M-parameter GPT, ~1-2 min on 2 cores
    python -m varuna.bench morph --quick         # tiny model: a smoke run of every path

One elastic job, started as the user would start it, resized from outside as the user would:

    varuna run --elastic -p 2 -d 1 --run-dir RUN -m varuna.bench._morph_worker SPEC.json
        ... `steps_before` steps ...
    varuna resize RUN -p 1 -d 2          <- the request (t = 0)
        the step in flight ends with the stop flag set; every rank checkpoints; exit 75
        the supervisor relaunches 1 x 2 with VARUNA_RESUME=latest; the engine loads the checkpoint
        ... `steps_after` steps; the job ends

Rank 0 of each launch logs timestamped events (see `_morph_worker`), with the seconds spent in
varuna.checkpoint's I/O calls; the supervisor's output lines are timestamped here as they arrive.
On the run directory's filesystem, a plain sequential write of as many bytes as the checkpoint
(one file, 8 MiB chunks, then fsync, as the checkpoint's files are fsynced before the commit)
gives the rate the checkpoint is compared with, in the same page-cache state as the checkpoint's:
its pages must be new ones. On a VM that hands freed memory back to its host (this one does: a
virtio balloon with free page reporting), the first touch of a page the host took back is slow,
and a write into such pages was measured here 2-3x slower than one into pages freed a moment ago
(a second later they are already gone). The checkpoint's page-cache pages are new ones: nothing
freed that much memory just before it. So the plain writes wait `plain_write_settle_s` after
the job (whose exit freed gigabytes), and each keeps its file until all are done, so that none
reuses another's pages; a "warm" write right after deleting them, the rate the checkpoint
would be compared with if it reused freed pages, is reported beside it, as is a write before
the job. Then a read-back CRC-32 pass over the committed checkpoint (what the checkpoint no
longer does) and a one-process dcp.save with DCP's stock writer say what the old way would cost.
Targets (reported, never asserted): request -> first resumed step <= 20 s; checkpoint write rate
>= 50% of the plain write rate.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from varuna.bench import bench_env, log, print_report, require_positive
from varuna.errors import ConfigError, LaunchError

__all__ = ["MorphBench", "full", "quick", "run", "plain_write", "crc_rate", "format_table"]

_ROOT = Path(__file__).resolve().parents[2]
_WORKER = "varuna.bench._morph_worker"
_EVENTS = "bench-events.jsonl"
TARGET_REQUEST_TO_STEP_S = 20.0
TARGET_WRITE_FRACTION = 0.5
MB = 1e6

DEFINITIONS = {
    "t = 0": "time.time() just before `python -m varuna resize RUN -p P -d D` is started",
    "bytes": "the checkpoint's size, engine.last_checkpoint['bytes'] (its manifest's 'bytes')",
    "write_s": "engine.last_checkpoint['seconds'] on rank 0: engine.checkpoint() from gathering the "
    "tensors to the commit of checkpoints/latest (DCP save with the CRC-32 of every tensor's bytes "
    "computed in memory, fsync of every file, extra.pt, manifest, renames)",
    "write_mb_s": "bytes / write_s / 1e6",
    "plain_write_mb_s": "bytes / seconds of an open-write(8 MiB chunks of one random block)-fsync of "
    "as many bytes to a new file in the run directory, one writer, into new page-cache pages as the "
    "checkpoint's are: `plain_write_settle_s` after the job, every file kept until the last is "
    "written; the median of `plain_write_repeats`",
    "write_fraction_of_plain": "write_mb_s / plain_write_mb_s",
    "plain_write_warm_mb_s": "the same write right after deleting the files of the plain writes, so "
    "that it reuses their just-freed pages (what plain_write_mb_s measured before it kept its files "
    "and waited: this VM's host had not yet taken those pages back); a reference, not the target's "
    "baseline, since the checkpoint's pages are not reused ones",
    "write_fraction_of_plain_warm": "write_mb_s / plain_write_warm_mb_s",
    "relaunch_s": "from the old job's last event (rank 0's engine.step() raising SystemExit 75, "
    "after its checkpoint) to the relaunched rank 0's module start (time.time() at import of the "
    "worker module: after Python started, varuna.worker imported torch and the ranks met)",
    "load_s": "engine.resume_info['seconds'] on the relaunched rank 0: resolve, verify the manifest "
    "(presence and size of every file, CRC-32 of .metadata and extra.pt), read extra.pt and the "
    "metadata, DCP load (each rank reads its tensors' bytes into them; every extent read is "
    "checked against its CRC-32 by one of the ranks that read it)",
    "request_to_resumed_step_s": "t = 0 to the end of the first step after the resume "
    "(engine.step() returned on rank 0)",
    "timeline_s": "each event's time since t = 0 (rank 0's events; supervisor lines as they arrive)",
    "breakdown_s": "consecutive differences of the timeline; they add up to request_to_resumed_step_s",
    "checkpoint_phases_s": "rank 0's wall seconds inside the calls varuna.checkpoint.save makes while "
    "checkpointing: dcp.save (writing every byte, checksumming it, fsync), crc32 (every CRC-32 "
    "computation: of the tensors' bytes in memory inside dcp.save, of .metadata and extra.pt after "
    "it), fsync (every os.fsync, those inside dcp.save too), collectives (barrier, "
    "broadcast_object_list; they include waiting for the other ranks); crc32 and fsync overlap "
    "dcp.save; other = write_s - dcp.save - collectives (gathering tensors, extra.pt, manifest, "
    "rank 0's fsyncs after dcp.save, renames)",
    "reference": "after the job, on the same filesystem: plain writes (new pages; reused pages; "
    "before the job); a CRC-32 pass reading back the committed checkpoint; dcp.save with DCP's "
    "stock writer (torch.save records) by one process of tensors of the checkpoint's keys and "
    "shapes; the wall time of `python -c 'import torch'`",
    "load_phases_s": "the same for the resume on the new rank 0: crc32 (of the small files in "
    "verify, and of the extents this rank checks inside dcp.load), dcp.load (every rank reads what "
    "its parameters and optimizer state need), other = load_s - dcp.load (verify, metadata, "
    "extra.pt, placeholders, broadcast of the verdict)",
}


@dataclass(kw_only=True, slots=True)
class MorphBench:
    """What the morph benchmark measures; see `full` and `quick` for the presets."""

    model: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `varuna.models.GPTConfig`."""
    global_batch_size: int = 4
    """Samples per optimizer step, the same in both shapes."""
    micro_batch_size: int = 1
    """Samples per micro-batch."""
    start_shape: tuple[int, int] = (2, 1)
    """P x D the job starts with."""
    to_shape: tuple[int, int] = (1, 2)
    """P x D the resize asks for."""
    steps_before: int = 2
    """Steps logged before the resize is requested (the request then lands in the next step)."""
    steps_after: int = 2
    """Steps the relaunched job runs before it ends."""
    max_steps: int = 40
    """A first launch that sees no stop request ends after this many steps (the bench then fails)."""
    job_timeout_s: float = 240.0
    """The whole elastic job (both launches) runs at most this long, or the bench fails naming it."""
    plain_write_repeats: int = 3
    """Plain sequential writes after the job; `plain_write_mb_s` is their median."""
    plain_write_settle_s: float = 3.0
    """Seconds between the job's end and the plain writes, so that the memory its exit freed is no
    longer at hand (here it was gone within a second) and the writes get new pages, as the
    checkpoint did."""
    early_checkpoint_step: int | None = None
    """If set, the first launch also checkpoints after this step, before the resize, as periodic
    checkpointing would (the morph's checkpoint is then not the first one of its processes)."""

    def __post_init__(self) -> None:
        require_positive(
            self,
            "global_batch_size",
            "micro_batch_size",
            "steps_before",
            "steps_after",
            "plain_write_repeats",
        )
        if self.max_steps <= self.steps_before:
            raise ConfigError(
                f"MorphBench.max_steps ({self.max_steps}) must exceed steps_before ({self.steps_before})"
            )
        if not self.plain_write_settle_s >= 0:
            raise ConfigError(
                f"MorphBench.plain_write_settle_s must be >= 0 seconds (got {self.plain_write_settle_s!r})"
            )
        early = self.early_checkpoint_step
        if early is not None and not 0 <= early < self.steps_before:
            raise ConfigError(
                f"MorphBench.early_checkpoint_step ({early}) must be in [0, steps_before) = [0, {self.steps_before}): "
                "it has to happen before the resize"
            )
        for name in ("start_shape", "to_shape"):
            P, D = getattr(self, name)
            if P < 1 or D < 1 or self.global_batch_size % (D * self.micro_batch_size):
                raise ConfigError(
                    f"MorphBench.{name} = {P}x{D}: global_batch_size ({self.global_batch_size}) must be a "
                    f"multiple of data x micro_batch_size ({D} x {self.micro_batch_size})"
                )


def full() -> MorphBench:
    """A ~98M-parameter GPT (d_model 768, 12 blocks, 12 heads, vocab 16384, seq 64), batch 4 of 1, 2x1 -> 1x2."""
    return MorphBench(model={"vocab_size": 16384, "seq_len": 64, "d_model": 768, "n_layer": 12, "n_head": 12})


def quick() -> MorphBench:
    """`gpt_tiny()`, 2 steps at 2x1, resize to 1x2, 1 step: every path in well under a minute."""
    from varuna.models import gpt_tiny

    return MorphBench(
        model=asdict(gpt_tiny()),
        steps_after=1,
        job_timeout_s=150.0,
        plain_write_repeats=1,
        plain_write_settle_s=1.0,
    )


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

    from varuna.checkpoint import stored_tensors

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
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120, env=_env())
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------- job


def _log(msg: str) -> None:
    log(msg)


def _env() -> dict[str, str]:
    return bench_env(120)


class _Lines:
    """Reads a process's output in a thread: each line is logged to a file and kept with its time."""

    def __init__(self, pipe: IO[bytes], log: Path) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._pump, args=(pipe, log), daemon=True)
        self._thread.start()

    def _pump(self, pipe: IO[bytes], log: Path) -> None:
        with open(log, "w") as out:
            for raw in iter(pipe.readline, b""):
                t, line = time.time(), raw.decode(errors="replace").rstrip("\n")
                self.lines.append((t, line))
                out.write(f"{t:.3f} {line}\n")
                out.flush()

    def join(self) -> None:
        self._thread.join(timeout=5)

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        return next((t for t, line in self.lines if rx.search(line)), None)

    def tail(self, n: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / _EVENTS
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # the line rank 0 is appending right now
            break
    return out


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the job's session (`varuna run` stops its ranks), SIGKILL it if that does not end it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def _run_job(bench: MorphBench, tmp: Path) -> tuple[list[dict[str, Any]], _Lines, dict[str, float]]:
    """Run the elastic job, resize it after `steps_before` steps; its events, output and request times."""
    (P, D), (P2, D2) = bench.start_shape, bench.to_shape
    name = f"morph {P}x{D} -> {P2}x{D2}"
    run_dir = tmp / "run"
    spec = {
        "model": bench.model,
        "global_batch_size": bench.global_batch_size,
        "micro_batch_size": bench.micro_batch_size,
        "steps_after": bench.steps_after,
        "max_steps": bench.max_steps,
        "early_checkpoint_step": bench.early_checkpoint_step,
        "hang_s": bench.job_timeout_s,
    }
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "varuna", "run", "--elastic", "-p", str(P), "-d", str(D)]
    cmd += ["--run-dir", str(run_dir), "--timeout", f"{bench.job_timeout_s:g}", "-m", _WORKER, str(spec_path)]
    log = tmp / "job.log"
    _log(f"{name}: starting ({' '.join(cmd[1:])})")
    deadline = time.monotonic() + bench.job_timeout_s
    proc = subprocess.Popen(
        cmd, env=_env(), cwd=_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = _Lines(proc.stdout, log)
    request: dict[str, float] = {}

    def fail(why: str) -> LaunchError:
        _stop(proc)
        lines.join()
        return LaunchError(
            f"benchmark job {name} {why}; run dir {run_dir}, its log: {log}; the end of it:\n{lines.tail()}"
        )

    try:
        while sum(e["event"] == "step" and e["launch"] == 1 for e in _events(run_dir)) < bench.steps_before:
            if proc.poll() is not None:
                raise fail(f"ended (exit code {proc.returncode}) before its {bench.steps_before} steps")
            if time.monotonic() > deadline:
                raise fail(f"did not log {bench.steps_before} steps within {bench.job_timeout_s:g} s")
            time.sleep(0.05)
        request["t"] = time.time()
        resize = subprocess.run(
            [sys.executable, "-m", "varuna", "resize", str(run_dir), "-p", str(P2), "-d", str(D2)],
            env=_env(), cwd=_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        request["returned"] = time.time()
        if resize.returncode != 0:
            raise fail(f"could not be resized: `varuna resize` exited {resize.returncode}: {resize.stderr}")
        _log(f"{name}: resize requested ({resize.stdout.strip()})")
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise fail(f"ran past {bench.job_timeout_s:g} s") from None
        lines.join()
        if code != 0:
            raise fail(f"failed (exit code {code})")
    except BaseException:
        if proc.poll() is None:
            _stop(proc)
        raise
    events = _events(run_dir)
    if not any(e["event"] == "done" and e["launch"] > 1 for e in events):
        raise LaunchError(
            f"benchmark job {name} exited 0 without a resumed launch finishing (no morph happened?); "
            f"see {log} and {run_dir / _EVENTS}"
        )
    return events, lines, request


# ---------------------------------------------------------------------------------------- report


def _one(events: list[dict[str, Any]], event: str, launch: int) -> dict[str, Any]:
    found = [e for e in events if e["event"] == event and e["launch"] == launch]
    if not found:
        raise LaunchError(f"the morph benchmark's event log has no {event!r} event for launch {launch}")
    return found[0]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _analyse(
    bench: MorphBench, events: list[dict[str, Any]], lines: _Lines, request: dict[str, float]
) -> dict[str, Any]:
    t0 = request["t"]
    old = 1
    new = max(e["launch"] for e in events)
    ckpt = _one(events, "checkpoint", old)
    stop_step = next(
        e for e in events if e["event"] == "step" and e["launch"] == old and e["step"] + 1 == ckpt["step"]
    )
    resumed_steps = [e for e in events if e["event"] == "step" and e["launch"] == new]
    engine_built = _one(events, "engine_built", new)
    resume_info = engine_built["resume_info"]
    if not resume_info:
        raise LaunchError(f"launch {new} of the morph benchmark did not resume from a checkpoint")
    (P2, D2) = bench.to_shape
    marks = {
        "resize_command_returned": request["returned"],
        "stop_step_computed": stop_step["start"] + stop_step["step_s"],
        "checkpoint_committed": stop_step["t"],
        "old_job_exit_raised": _one(events, "exit", old)["t"],
        "supervisor_morph_line": lines.first(r"varuna: morphing \d+x\d+ -> "),
        "new_job_launched": lines.first(rf"varuna: {P2 * D2} ranks \(pipeline {P2} x data {D2}\)"),
        "new_process_started": _one(events, "process_start", new)["t"],
        "new_module_started": _one(events, "module_start", new)["t"],
        "new_imports_done": _one(events, "imported", new)["t"],
        "new_model_built": _one(events, "model_built", new)["t"],
        "new_engine_built": engine_built["t"],
        "new_optimizer_set": _one(events, "optimizer_set", new)["t"],
        "first_resumed_step_end": resumed_steps[0]["t"],
    }
    timeline = {k: (round(v - t0, 3) if v is not None else None) for k, v in marks.items()}
    breakdown: dict[str, float] = {}
    known = [(k, v) for k, v in marks.items() if v is not None and k != "resize_command_returned"]
    labels = {
        "stop_step_computed": "request_to_stop_agreed (rest of the step in flight)",
        "checkpoint_committed": "checkpoint (engine.checkpoint, collective)",
        "old_job_exit_raised": "to the exit at the next step() call",
        "supervisor_morph_line": "old job teardown (MPI finalize, mpiexec exit, supervisor)",
        "new_job_launched": "supervisor to the new mpiexec",
        "new_process_started": "mpiexec starting the ranks",
        "new_module_started": "Python start, import torch, rendezvous (varuna.worker)",
        "new_imports_done": "import varuna.engine (torch.distributed.checkpoint), .data, .models",
        "new_model_built": "model construction (GPT init)",
        "new_engine_built": "Varuna(...): trace, partition, groups, broadcast, resume",
        "new_optimizer_set": "AdamW(...) (first one imports torch._dynamo) + set_optimizer",
        "first_resumed_step_end": "first resumed step (batch + step)",
    }
    prev = t0
    for k, v in known:
        breakdown[labels[k]] = round(v - prev, 3)
        prev = v
    load_s = float(resume_info["seconds"])
    engine_s = marks["new_engine_built"] - marks["new_model_built"]
    breakdown_engine = {"load (resume_info seconds)": round(load_s, 3), "rest": round(engine_s - load_s, 3)}
    nbytes = int(ckpt["bytes"])
    write_s = float(ckpt["seconds"])
    ckpt_phases = dict(ckpt.get("phases") or {})
    if ckpt_phases:
        inside = sum(ckpt_phases.get(k, 0.0) for k in ("dcp.save", "collectives"))
        ckpt_phases["other"] = round(write_s - inside, 4)
    load_phases = dict(engine_built.get("phases") or {})
    if load_phases:
        load_phases["other"] = round(load_s - load_phases.get("dcp.load", 0.0), 4)
    relaunch_s = marks["new_module_started"] - marks["old_job_exit_raised"]
    return {
        "bytes": nbytes,
        "write_s": round(write_s, 3),
        "write_mb_s": round(nbytes / write_s / MB, 1),
        "relaunch_s": round(relaunch_s, 3),
        "load_s": round(load_s, 3),
        "load_mb_s": round(nbytes / load_s / MB, 1) if load_s > 0 else None,
        "request_to_resumed_step_s": round(marks["first_resumed_step_end"] - t0, 3),
        "request_command_s": round(request["returned"] - t0, 3),
        "checkpoint_step": ckpt["step"],
        "early_checkpoint": next(
            (
                {k: e[k] for k in ("step", "bytes", "seconds", "phases") if k in e}
                for e in events
                if e["event"] == "early_checkpoint"
            ),
            None,
        ),
        "timeline_s": timeline,
        "breakdown_s": breakdown,
        "engine_construction_s": breakdown_engine,
        "checkpoint_phases_s": ckpt_phases,
        "load_phases_s": load_phases,
        "step_s": {
            "before": [round(e["step_s"], 3) for e in events if e["event"] == "step" and e["launch"] == old],
            "after": [round(e["step_s"], 3) for e in resumed_steps],
        },
        "losses": {
            "before": [round(e["loss"], 5) for e in events if e["event"] == "step" and e["launch"] == old],
            "after": [round(e["loss"], 5) for e in resumed_steps],
        },
    }


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
    _log(f"plain write of {12 * params / MB:.0f} MB before the job (memory not recently used)")
    cold = plain_write(tmp, 12 * params)
    events, lines, request = _run_job(bench, tmp)
    load_after_job = _load()
    report = _analyse(bench, events, lines, request)
    _log(
        f"job done; {bench.plain_write_repeats} plain writes of {report['bytes'] / MB:.0f} MB in {tmp / 'run'} "
        f"after {bench.plain_write_settle_s:g} s, then one into their freed pages"
    )
    plains, warm = plain_writes(
        tmp / "run", report["bytes"], bench.plain_write_repeats, bench.plain_write_settle_s
    )
    plain = sorted(plains, key=lambda r: r["mb_s"])[len(plains) // 2]
    committed = Path(_one(events, "checkpoint", 1)["path"])
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


def format_table(report: dict[str, Any]) -> str:
    """The headline numbers, the timeline and its breakdown as aligned text."""
    m, t = report["model"], report["targets"]
    c = m["config"]
    lines = [
        f"GPT {c.get('n_layer')} blocks, d_model {c.get('d_model')}, vocab {c.get('vocab_size')}, seq "
        f"{c.get('seq_len')}: {report['params'] / 1e6:.1f}M params, AdamW; batch {m['global_batch_size']} "
        f"in micro-batches of {m['micro_batch_size']}; {report['from_shape']} -> {report['to_shape']} on "
        f"{m['host_cores']} cores (load {m['load_before'][0]:.2f} before, {m['load_after_job'][0]:.2f} after the job)",
        f"checkpoint {report['bytes'] / MB:.0f} MB in {report['write_s']:.2f} s = {report['write_mb_s']:.0f} MB/s; "
        f"plain write {report['plain_write_mb_s']:.0f} MB/s (into reused pages: {report['plain_write_warm_mb_s']:.0f}); "
        f"fraction {report['write_fraction_of_plain']:.2f} (of reused: {report['write_fraction_of_plain_warm']:.2f}) "
        f"(target {t['write_fraction_of_plain']['target']}: {'met' if t['write_fraction_of_plain']['met'] else 'NOT met'})",
        f"request -> first resumed step {report['request_to_resumed_step_s']:.2f} s (target "
        f"{t['request_to_resumed_step_s']['target']}: {'met' if t['request_to_resumed_step_s']['met'] else 'NOT met'}); "
        f"relaunch {report['relaunch_s']:.2f} s; load {report['load_s']:.2f} s",
        "",
    ]
    w = max(len(k) for k in report["breakdown_s"])
    lines.append(f"{'since the request':<{w + 4}} {'s':>8}")
    for label, seconds in report["breakdown_s"].items():
        lines.append(f"  + {label:<{w}} {seconds:>8.2f}")
    lines.append(f"  = {'first resumed step ends':<{w}} {report['request_to_resumed_step_s']:>8.2f}")
    for title, key in (("checkpoint", "checkpoint_phases_s"), ("load", "load_phases_s")):
        if report.get(key):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in report[key].items())
            lines.append(f"{title} phases (rank 0, s): {parts}")
    steps = report["step_s"]
    lines.append(
        f"step s before: {', '.join(f'{s:.2f}' for s in steps['before'])}; after: "
        f"{', '.join(f'{s:.2f}' for s in steps['after'])}; wall time {report['wall_s']:.0f} s"
    )
    return "\n".join(lines)


def main(args: Any) -> int:
    """Entry of `python -m varuna.bench morph`; `args` has `json` and `quick`."""
    report = run(quick() if args.quick else full())
    return print_report(report, format_table(report), args.json)
