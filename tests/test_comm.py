"""Tests of varuna/comm.py: headers, and arrivals seen without blocking (2 ranks over gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from varuna.comm import decode_header, encode_header
from varuna.errors import PartitionError

REPO = Path(__file__).resolve().parents[1]


def test_header_round_trips_shapes_and_dtypes() -> None:
    tensors = [
        torch.zeros(2, 3),
        torch.zeros(5, dtype=torch.int64),
        torch.zeros(1, 2, 3, dtype=torch.bfloat16),
    ]
    specs, is_tuple = decode_header(encode_header(tensors, True))
    assert is_tuple and specs == [(t.dtype, tuple(t.shape)) for t in tensors]
    with pytest.raises(PartitionError, match="cannot send a torch.complex64 tensor"):
        encode_header([torch.zeros(1, dtype=torch.complex64)], False)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_an_arrival_is_seen_without_waiting_for_it(tmp_path: Path) -> None:
    """What Varuna's pull-ahead relies on: gloo's works report completion only once waited for,
    so without the watcher threads `activation_ready`/`grad_ready` would stay False for good."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env["VARUNA_P2P_WATCH"] = "1"  # off by default (see README); without, no arrival is ever seen
    script = str(REPO / "tests" / "scripts" / "p2p_arrivals.py")
    argv = [
        sys.executable,
        "-m",
        "varuna",
        "run",
        "--pipeline",
        "2",
        "--run-dir",
        "run",
        "--timeout",
        "90",
        script,
    ]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        if "ARRIVALS " in line:
            seen[int(line.split("[rank ")[1].split()[0])] = json.loads(line.split("ARRIVALS ", 1)[1])
    receiver, sender = seen[0], seen[1]
    assert receiver["ready_at_once"] is False  # sent 0.3 s later
    assert receiver["after_s"] is not None and receiver["after_s"] > 0.1  # seen when it came, not before
    assert receiver["value"] == torch.arange(12.0).reshape(3, 4).tolist()
    assert sender["grad_ready_at_once"] is False
    assert sender["grad_after_s"] is not None and sender["grad_after_s"] > 0.1
    assert sender["grad"] == (2 * torch.arange(12.0).reshape(3, 4)).tolist()


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_activations_go_to_receives_posted_early_and_shape_changes_still_arrive(tmp_path: Path) -> None:
    """After the first step an activation moves to receives posted with its previous shape (so it
    travels while the receiver computes); a micro-batch whose shape changes, a tuple with an int
    tensor, and both receiving paths (with and without the watcher threads) still deliver exactly."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = str(REPO / "tests" / "scripts" / "p2p_early.py")
    argv = [
        sys.executable,
        "-m",
        "varuna",
        "run",
        "--pipeline",
        "2",
        "--run-dir",
        "run",
        "--timeout",
        "90",
        script,
    ]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        if "EARLY " in line:
            seen[int(line.split("[rank ")[1].split()[0])] = json.loads(line.split("EARLY ", 1)[1])
    for watch in ("0", "1"):
        assert seen[0][watch]["wrong"] == [] and seen[1][watch]["wrong"] == []
        # 5 steps x 3 micro-batches: step 0 has no early receives; micro-batch 1 changes shape at
        # step 3 and back at step 4, so it misses twice: 15 - 3 - 2 = 10
        assert seen[0][watch]["early"] == 10
