"""Shared fixtures. The tiers live in folders: unit/ (no processes), multirank/ (`varuna run` jobs),
multihost/ (jobs across network-namespace hosts, as root), browser/ (headless Chromium), bench/ (benchmarks).

`varuna_run` and `varuna_popen` are the one place that builds a `varuna run` command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import _helpers`

from _helpers import REPO  # noqa: E402


def _command(
    script_and_args: Sequence[str | Path],
    *,
    pipeline: int,
    data: int,
    run_dir: Path,
    flags: Sequence[str],
    wrap: Sequence[str] = (),
) -> list[str]:
    return [
        *wrap,
        sys.executable,
        "-m",
        "varuna",
        "run",
        *flags,
        "--pipeline",
        str(pipeline),
        "--data",
        str(data),
        "--run-dir",
        str(run_dir),
        *map(str, script_and_args),
    ]


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(extra or {})}


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the launcher's process group, then SIGKILL what is left of it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="session")
def varuna_run() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `varuna run [flags] --pipeline P --data D --run-dir DIR script args...` to the end.

    The job gets PYTHONPATH=<repo>, OMP_NUM_THREADS=1 (then `env` on top) and a closed stdin; past
    `timeout` seconds its process group is stopped and subprocess.TimeoutExpired raised. With `check`,
    a non-zero exit fails the test with the tail of the output. `wrap` is a command prefix that
    `varuna run` runs under (`NetnsHosts.command(host, [])`: on a namespace host); it must exec.
    """

    def run(
        script_and_args: Sequence[str | Path],
        *,
        pipeline: int,
        data: int = 1,
        run_dir: Path,
        flags: Sequence[str] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 300,
        check: bool = True,
        wrap: Sequence[str] = (),
    ) -> subprocess.CompletedProcess[str]:
        cmd = _command(script_and_args, pipeline=pipeline, data=data, run_dir=run_dir, flags=flags, wrap=wrap)
        proc = subprocess.Popen(
            cmd,
            env=_env(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        except BaseException:
            _kill_group(proc, grace_s=2.0)
            raise
        done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check and done.returncode != 0:
            pytest.fail(f"{' '.join(cmd)} exited with {done.returncode}:\n{(out + err)[-4000:]}")
        return done

    return run


@pytest.fixture(scope="session")
def varuna_popen() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start `varuna run ...` (as `varuna_run`) without waiting, for jobs that run concurrently.

    Extra keywords go to subprocess.Popen (stdout, stderr, text, ...). Any job still running when
    the session ends is stopped with its process group.
    """
    started: list[subprocess.Popen] = []

    def popen(
        script_and_args: Sequence[str | Path],
        *,
        pipeline: int,
        data: int = 1,
        run_dir: Path,
        flags: Sequence[str] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        wrap: Sequence[str] = (),
        **popen_kw: Any,
    ) -> subprocess.Popen:
        cmd = _command(script_and_args, pipeline=pipeline, data=data, run_dir=run_dir, flags=flags, wrap=wrap)
        proc = subprocess.Popen(
            cmd, env=_env(env), cwd=cwd, stdin=subprocess.DEVNULL, start_new_session=True, **popen_kw
        )
        started.append(proc)
        return proc

    yield popen
    for proc in started:
        if proc.poll() is None:
            _kill_group(proc, grace_s=5.0)
