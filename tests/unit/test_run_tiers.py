"""tests/run_tiers.py, the second part of `make test`: the background stream's CPU cgroup and its fallback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import run_tiers


def test_without_root_there_is_no_cgroup_and_the_reason_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    group, said = run_tiers.make_cgroup("varuna-tests-unit")
    assert group is None and "not root" in said


@pytest.mark.skipif(os.geteuid() != 0, reason="CPU cgroups need root")
def test_the_background_cgroup_has_a_low_share_takes_the_child_and_is_removed() -> None:
    """A child started with `_join` runs in the cgroup (not this process); `kill_cgroup` ends it, as a
    stopped `make test` ends the background stream, whatever session its processes started; then the
    cgroup goes."""
    group, said = run_tiers.make_cgroup(f"varuna-tests-unit-{os.getpid()}")
    if group is None:
        pytest.skip(said)
    try:
        share = group / ("cpu.shares" if group.parent == run_tiers.CGROUP_V1 else "cpu.weight")
        expected = run_tiers.SHARES_V1 if share.name == "cpu.shares" else run_tiers.WEIGHT_V2
        assert int(share.read_text()) == expected
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"],
            stdin=subprocess.PIPE,
            preexec_fn=run_tiers._join(group),
        )
        try:
            members = (group / "cgroup.procs").read_text().split()
            assert str(child.pid) in members
            assert str(os.getpid()) not in members  # only the child moved
            run_tiers.kill_cgroup(group)
            assert child.wait(timeout=30) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
    finally:
        run_tiers.remove_cgroup(group)
    assert not group.exists()
