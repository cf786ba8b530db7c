"""Run every tier but the unit tier as two pytest streams side by side: `make test`'s second part.

The tests that start processes leave about a third of this machine's two cores idle: shaped links,
spot traces, pip and notebook starts mostly wait. So they run in two streams at once:

- the **foreground** stream, the tests marked `foreground` (their assertions depend on wall-clock time:
  deadlines, link rates, traces; or they mostly wait), at the normal CPU priority;
- the **background** stream, every other test (correctness of CPU-bound jobs), in a CPU cgroup of a low
  share (`cpu.shares` 128 against the default 1024, or `cpu.weight` 12 against 100), so it takes the
  cores the foreground leaves idle and the foreground's timing is what it would be alone. A cgroup, not
  `nice`: the jobs start sessions of their own, and with the kernel's autogroups a new session's processes
  would be weighed as a group of their own again.

Where no CPU cgroup can be made (not root, no cpu controller) the two streams run one after the other,
and the output says so. The foreground prints as it runs; the background's output goes to `--log` and is
printed when both are done. The exit status is the first non-zero of the two (foreground first).
Stopped (Ctrl-C, SIGTERM), it kills every process in the background's cgroup, the jobs its tests
started in sessions of their own included, and removes the cgroup.

    python tests/run_tiers.py [--log FILE] [pytest options...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
SHARES_V1 = 128
WEIGHT_V2 = 12


def make_cgroup(name: str) -> tuple[Path | None, str]:
    """A CPU cgroup of a low share for the background stream, and what was made (or why none was)."""
    if os.geteuid() != 0:
        return None, "not root: no CPU cgroup for the background stream"
    try:
        if (CGROUP_V1 / "cpu.shares").exists():
            group = CGROUP_V1 / name
            group.mkdir(exist_ok=True)
            (group / "cpu.shares").write_text(str(SHARES_V1))
            return group, f"background stream in {group} (cpu.shares {SHARES_V1} of 1024)"
        if "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text().split():
            control = CGROUP_V2 / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
            group = CGROUP_V2 / name
            group.mkdir(exist_ok=True)
            (group / "cpu.weight").write_text(str(WEIGHT_V2))
            return group, f"background stream in {group} (cpu.weight {WEIGHT_V2} of 100)"
    except OSError as err:
        return None, f"no CPU cgroup for the background stream ({err})"
    return None, "no CPU cgroup controller (cgroup v1 cpu or v2 cpu) on this machine"


def kill_cgroup(group: Path) -> None:
    """SIGKILL every process still in the cgroup: the stream's pytest and what its tests started,
    the jobs too, which run in sessions of their own (a stopped stream leaves nothing behind)."""
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_cgroup(group: Path) -> None:
    """Remove the cgroup once its processes are gone (a few seconds' grace for stragglers)."""
    for _ in range(20):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.5)
    print(f"run_tiers: could not remove {group} (processes still in it)", file=sys.stderr)


def _pytest(marks: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "--ignore=tests/unit", "-m", marks, *extra]


def _join(into: Path) -> Callable[[], None]:
    """preexec_fn: move the child into cgroup `into` before it execs pytest (its children inherit it)."""

    def join() -> None:
        (into / "cgroup.procs").write_text(str(os.getpid()))

    return join


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, default=REPO / ".venv" / "background-tests.log")
    args, extra = parser.parse_known_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    group, said = make_cgroup(f"varuna-tests-{os.getpid()}")
    print(f"run_tiers: {said}", flush=True)
    foreground = _pytest("foreground", extra)
    background = _pytest("not foreground", extra)
    if group is None:  # one after the other, both printing as they run
        rc_fg = subprocess.run(foreground, cwd=REPO, env=env, stdin=subprocess.DEVNULL).returncode
        rc_bg = subprocess.run(background, cwd=REPO, env=env, stdin=subprocess.DEVNULL).returncode
        return rc_fg or rc_bg
    args.log.parent.mkdir(parents=True, exist_ok=True)
    # a SIGTERM (a CI's timeout) ends both streams and removes the cgroup, as an exception does
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    started = time.monotonic()
    with open(args.log, "w") as log:
        back = subprocess.Popen(
            background,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_join(group),
            start_new_session=True,
        )
        try:
            rc_fg = subprocess.run(foreground, cwd=REPO, env=env, stdin=subprocess.DEVNULL).returncode
            if back.poll() is None:
                print(
                    f"run_tiers: foreground done; waiting for the background stream ({args.log})", flush=True
                )
            rc_bg = back.wait()
        except BaseException:  # stopped (Ctrl-C, SIGTERM): the background stream and its jobs with it
            kill_cgroup(group)
            back.wait(timeout=60)
            raise
        finally:
            remove_cgroup(group)
    print(f"\n==== background stream ({time.monotonic() - started:.0f} s in all) ====", flush=True)
    sys.stdout.write(args.log.read_text())
    return rc_fg or rc_bg


if __name__ == "__main__":
    sys.exit(main())
