"""`varuna run --elastic`: supervise a job through morphs and crashes, like Varuna's manager but
without ssh, pkill or sleep loops.

    launch P x D ──> exit 0 ─────────────> done
        ▲        ├─> exit MORPH_EXIT ───> next shape: the oldest `varuna resize` request, else an
        │        │                        edited hostfile's slot count, else the same; relaunch
        │        └─> any other failure ──> relaunch the same shape from checkpoints/latest, at most
        └──────────────────────────────── --max-restarts times
Every relaunch resumes from `checkpoints/latest` (VARUNA_RESUME=latest).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from varuna.elastic.protocol import MORPH_EXIT, Shape, take_resize
from varuna.elastic.reshape import choose_shape, read_engine_info
from varuna.errors import ConfigError
from varuna.launch.hostfile import hostfile_slots
from varuna.launch.job import run_job
from varuna.planner.cluster import Placement

__all__ = ["run_elastic", "hostfile_slots", "next_shape", "USER_STOP"]

USER_STOP = {128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGKILL}
"""Exit codes of a job stopped by a signal from its user: a stop, not a crash."""


def next_shape(run_dir: Path, current: Shape, hostfile: Path | None, slots: int | None) -> Shape:
    """The shape to relaunch in after a morph exit, for `varuna run --elastic` and the controller alike:
    the oldest `varuna resize` request, else (when the hostfile's slot count is no longer `slots`) a
    shape for the new count, else `current`."""
    requested = take_resize(run_dir)
    if requested is not None:
        return requested
    if hostfile is not None and slots is not None:
        now = hostfile_slots(hostfile)
        if now != slots and (run_dir / "engine.json").exists():
            return choose_shape(now, read_engine_info(run_dir / "engine.json"))
    return current


def run_elastic(
    script_argv: list[str],
    *,
    pipeline: int,
    data: int,
    run_dir: Path | None,
    hostfile: Path | None = None,
    max_restarts: int = 3,
    timeout_s: float | None = None,
    placement: Placement = "block",
) -> int:
    """Run the job, relaunching it after morphs and (up to `max_restarts`) crashes, every launch in
    `placement`; its final exit code."""
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    if run_dir is None:
        run_dir = Path.cwd() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(run_dir).absolute()
    shape, restarts, launches = Shape(pipeline, data), 0, 0
    slots = hostfile_slots(hostfile) if hostfile is not None else None
    while True:
        launches += 1
        code = run_job(
            script_argv,
            pipeline=shape.pipeline,
            data=shape.data,
            run_dir=run_dir,
            hostfile=hostfile,
            extra_env={"VARUNA_RESUME": "latest", "VARUNA_LAUNCH": str(launches)},
            timeout_s=timeout_s,
            placement=placement,
        )
        if code == 0 or code in USER_STOP or code == 124:
            return code
        if code == MORPH_EXIT:
            new = next_shape(run_dir, shape, hostfile, slots)
            if hostfile is not None:
                slots = hostfile_slots(hostfile)
            print(
                f"varuna: morphing {shape.pipeline}x{shape.data} -> {new.pipeline}x{new.data} from the latest checkpoint",
                file=sys.stderr,
                flush=True,
            )
            shape = new
            continue
        restarts += 1
        if restarts > max_restarts:
            print(f"varuna: giving up after {max_restarts} restarts (exit code {code})", file=sys.stderr)
            return code
        print(
            f"varuna: job failed (exit code {code}); restart {restarts} of {max_restarts} from the latest checkpoint",
            file=sys.stderr,
            flush=True,
        )
