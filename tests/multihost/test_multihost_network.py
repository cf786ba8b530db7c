"""The planner decides with the network it measured: `varuna profile` across two namespace hosts,
their link unshaped and then shaped to a slow Ethernet, and `varuna plan` on each profile.

    h1  mpiexec (the launcher)          h2  ranks 0, 1          h3  ranks 2, 3

The profile measures the link between hosts (a ping-pong between rank 0 and the first rank of
another host) beside the ones inside a host, and records how many ranks a host holds; the planner
prices every crossing with them (`varuna.planner.cluster`) and tries both placements of ranks on
hosts. A tiny GPT's gradients are large against its activations, so on the unshaped link data
parallelism wins and on the slow one a pipeline whose all-reduces stay inside a host does.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import REPO, SCRIPTS

from varuna.bench.netns import NetnsHosts
from varuna.planner.costs import CostTable

pytestmark = [pytest.mark.multihost, pytest.mark.foreground, pytest.mark.timeout(400)]
SLOW_MBIT = 20


def profile(hosts: NetnsHosts, folder: Path, mbit: float | None) -> CostTable:
    """`varuna profile --gpus 4` from h1 with ranks on h2 and h3, their links shaped to `mbit`."""
    folder.mkdir(parents=True)
    hostfile = hosts.hostfile(folder / "hosts", {"h2": 2, "h3": 2})
    argv = [sys.executable, "-m", "varuna", "profile", "--gpus", "4", "--hostfile", str(hostfile)]
    argv += ["--run-dir", str(folder / "run"), "--micro-batch-sizes", "2", "--repeats", "2"]
    argv += ["--timeout", "240", str(SCRIPTS / "profile_gpt.py"), "--layers", "4"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "VARUNA_MPIEXEC_ARGS": hosts.mpiexec_args,
    }
    for host in ("h2", "h3"):
        hosts.shape(host, mbit)
    try:
        done = subprocess.run(
            hosts.command("h1", argv),
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            stdin=subprocess.DEVNULL,
            cwd=folder,
        )
    finally:
        for host in ("h2", "h3"):
            hosts.shape(host, None)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return CostTable.load(folder / "run" / "profile.json")


def best_plan(profile_json: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "varuna", "plan", "--profile", str(profile_json), "--gpus", "4"]
        + ["--global-batch", "32", "--memory", "16GiB", "--json", "--top", "40"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["ranked"][0]


def test_multihost_the_plan_follows_the_measured_network(hosts: NetnsHosts, tmp_path: Path) -> None:
    fast = profile(hosts, tmp_path / "fast", None)
    slow = profile(hosts, tmp_path / "slow", SLOW_MBIT)
    for table in (fast, slow):
        assert table.network.gpus_per_host == 2  # two ranks on each host, measured
        assert table.network.inter_host_latency_s > 0
    # the shaped link's bandwidth as measured: the set rate within 15% (a ping-pong's answer is
    # one float, so the measurement is one direction's rate)
    assert slow.network.inter_host_bandwidth_Bps == pytest.approx(SLOW_MBIT * 1e6 / 8, rel=0.15)
    assert fast.network.inter_host_bandwidth_Bps > 10 * slow.network.inter_host_bandwidth_Bps
    # streams both ways at once against one way, for one and for two each way (two ranks a host);
    # a ratio of timings: only that each is measured, never its size
    for table in (fast, slow):
        duplex = table.network.inter_host_duplex
        assert sorted(duplex) == [1, 2] and all(math.isfinite(f) and f > 0 for f in duplex.values()), duplex
    # the slow profile stops its all-reduce sizes where one would take more than a second
    assert max(b for b, _ in slow.network.allreduce[4]) < max(b for b, _ in fast.network.allreduce[4])

    fast_pick = best_plan(tmp_path / "fast" / "run" / "profile.json")
    slow_pick = best_plan(tmp_path / "slow" / "run" / "profile.json")
    # unshaped: data parallelism (all-reduces are cheap); slow: a pipeline whose stages' replicas
    # share a host (cyclic: all-reduces inside hosts, only activations cross). The planner prices the
    # all-reduces across hosts as the profile measured them (on two shared cores, unshaped, gloo's
    # all-reduce takes a few times the ring model's time), so the batch is large enough that the
    # unshaped step is mostly compute.
    assert fast_pick["data"] > fast_pick["pipeline"], fast_pick
    assert slow_pick["pipeline"] > 1 and slow_pick["placement"] == "cyclic", slow_pick
