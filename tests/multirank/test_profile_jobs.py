"""`varuna profile --gpus 2` end to end."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _helpers import REPO, SCRIPTS

from varuna.comm.rendezvous import usable_cores
from varuna.models import GPT, gpt_tiny
from varuna.planner.costs import CostTable
from varuna.profile.measure import (
    model_signature,
)

pytestmark = pytest.mark.multirank
SCRIPT = str(SCRIPTS / "profile_gpt.py")


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_varuna_profile_two_ranks(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "varuna", "profile", "--gpus", "2", "--run-dir", str(run_dir)]
    command += ["--micro-batch-sizes", "1,2", "--repeats", "2", "--timeout", "100", SCRIPT, "--layers", "3"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"profile in {run_dir / 'profile.json'}" in done.stderr
    table = CostTable.load(run_dir / "profile.json")
    assert table.num_segments == 3 and table.micro_batch_sizes == [1, 2]
    assert table.model_signature == model_signature(GPT(dataclasses.replace(gpt_tiny(), n_layer=3)))
    assert table.network.p2p_latency_s > 0 and table.network.p2p_bandwidth_Bps > 0
    assert list(table.network.allreduce) == [2]
    assert all(t > 0 for _, t in table.network.allreduce[2]) and len(table.network.allreduce[2]) == 5
    assert table.network.allreduce_by_world == {2: table.network.allreduce}
    assert set(table.compute_slowdown) == {1, 2} and table.compute_slowdown[1] == 1.0
    messages = table.network.message_s
    assert set(messages) == {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "DELAY_F"}
    assert messages["SEND_F"] > 0 and messages["RECV_F"] > 0 and all(v >= 0 for v in messages.values())
    assert table.network.reports_arrival is False  # gloo: a receive is "completed" only once waited for
    assert list(table.network.delivery_s) == [1]  # 2 ranks: the sender alone busy
    assert set(table.network.delivery_s[1]) == {"F", "B", "SEND_F", "SEND_B"}
    assert all(v >= 0 for v in table.network.delivery_s[1].values())
    assert table.network.delivery_s[1]["SEND_F"] > 0  # a send is timed, never free
    assert [b for b, _ in table.network.message_cpu] == [1 << 16, 1 << 20]
    assert all(t > 0 for _, t in table.network.message_cpu)  # a message costs CPU on both ranks
    log = (run_dir / "logs" / "rank0.log").read_text()
    if usable_cores() >= 2:  # each rank a core of its own: the profiled compute holds what an action costs
        assert "every rank has a core of its own: no runtime cost per action" in log
        assert table.action_overhead_s == 0.0
    else:  # the calibration ran (a 2-stage spin pipeline on the job's ranks); on a model this tiny the
        # simulator's message terms may already overcharge it, so 0 is a valid fit, a step's worth is not
        assert "the runtime's own cost per action (2-stage pipeline" in log
        assert 0 <= table.action_overhead_s < 0.01
    for written in ("engine.json", "events", "cache", "checkpoints"):  # what an engine writes into a run dir
        assert not (run_dir / written).exists()  # neither the real engine nor the calibration's ran here
    assert "varuna profile" in log  # the progress bar


@pytest.mark.multirank
@pytest.mark.timeout(150)
def test_varuna_profile_under_the_strict_nccl_rules_leaves_out_the_early_links_costs(tmp_path: Path) -> None:
    """Where the engine takes the serial links (NCCL; `VARUNA_NCCL_RULES=strict` on gloo), the
    profile does not time the early-receive links (they would hang there) and the rest completes."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "varuna", "profile", "--gpus", "2", "--run-dir", str(run_dir)]
    command += ["--micro-batch-sizes", "1", "--repeats", "2", "--timeout", "100", SCRIPT, "--layers", "3"]
    env = {**os.environ, "VARUNA_NCCL_RULES": "strict", "VARUNA_TIMEOUT": "20"}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    network = CostTable.load(run_dir / "profile.json").network
    assert network.p2p_latency_s > 0 and network.p2p_bandwidth_Bps > 0 and list(network.allreduce) == [2]
    assert network.message_s == {} and network.delivery_s == {} and network.message_cpu == []
    assert network.reports_arrival is False
