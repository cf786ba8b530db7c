"""The morph benchmark's job: `varuna run --elastic` started as the user would, resized from outside.

`run_job` starts the job (see `varuna.bench.morph.driver`'s docstring for its course), waits for
`steps_before` steps in rank 0's event log, runs `varuna resize`, waits for the relaunched job to
end and returns the events, the supervisor's timestamped output lines and the request's times.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from varuna.bench import ROOT, bench_env, log
from varuna.bench.common import stop_job
from varuna.errors import LaunchError

if TYPE_CHECKING:
    from varuna.bench.morph.config import MorphBench

_WORKER = "varuna.bench.morph.worker"
_EVENTS = "bench-events.jsonl"


def job_env() -> dict[str, str]:
    """The environment of the job, of `varuna resize` and of every other process the bench starts."""
    return bench_env(120)


class Lines:
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


def run_job(bench: MorphBench, tmp: Path) -> tuple[list[dict[str, Any]], Lines, dict[str, float]]:
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
    log_path = tmp / "job.log"
    log(f"{name}: starting ({' '.join(cmd[1:])})")
    deadline = time.monotonic() + bench.job_timeout_s
    proc = subprocess.Popen(
        cmd,
        env=job_env(),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert proc.stdout is not None
    lines = Lines(proc.stdout, log_path)
    request: dict[str, float] = {}

    def fail(why: str) -> LaunchError:
        stop_job(proc)
        lines.join()
        return LaunchError(
            f"benchmark job {name} {why}; run dir {run_dir}, its log: {log_path}; the end of it:\n{lines.tail()}"
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
            env=job_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        request["returned"] = time.time()
        if resize.returncode != 0:
            raise fail(f"could not be resized: `varuna resize` exited {resize.returncode}: {resize.stderr}")
        log(f"{name}: resize requested ({resize.stdout.strip()})")
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            raise fail(f"ran past {bench.job_timeout_s:g} s") from None
        lines.join()
        if code != 0:
            raise fail(f"failed (exit code {code})")
    except BaseException:
        if proc.poll() is None:
            stop_job(proc)
        raise
    events = _events(run_dir)
    if not any(e["event"] == "done" and e["launch"] > 1 for e in events):
        raise LaunchError(
            f"benchmark job {name} exited 0 without a resumed launch finishing (no morph happened?); "
            f"see {log_path} and {run_dir / _EVENTS}"
        )
    return events, lines, request
