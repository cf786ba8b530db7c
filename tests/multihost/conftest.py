"""The multihost tier: `varuna run` jobs whose ranks run on hosts made of Linux network namespaces
(`varuna.bench.netns.NetnsHosts`). Needs root and iproute2; every test here is skipped, with the reason, where
namespaces cannot be made."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from _helpers import REPO

from varuna.bench.netns import NetnsHosts, unavailable


@pytest.fixture(scope="session")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsHosts]:
    """Three namespace hosts h1, h2, h3 on 10.77.0.0/24 for the session, removed at its end (also when a
    test fails; a killed session's are removed by the next one)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    made = NetnsHosts(3, workdir=tmp_path_factory.mktemp("hosts")).up()
    try:
        yield made
    finally:
        made.down()


@pytest.fixture(scope="session")
def on_host(hosts: NetnsHosts) -> Callable[..., str]:
    """Run `python -c CODE` on a namespace host (repository on PYTHONPATH) and return its stdout;
    a non-zero exit fails the test with its stderr."""

    def run(host: str, code: str, *, env: dict[str, str] | None = None, timeout: float = 60) -> str:
        full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        done = subprocess.run(
            hosts.command(host, [sys.executable, "-c", code]),
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            pytest.fail(f"on {host}: python -c ... exited with {done.returncode}:\n{done.stderr[-3000:]}")
        return done.stdout

    return run
