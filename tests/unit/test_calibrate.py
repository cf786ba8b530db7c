"""The runtime's cost per action (`varuna.profile.calibrate`): the fit and the host's core sharing.

The collective part, a real spin pipeline on every rank, runs where ranks share a host's cores: in
the planner bench's 4-rank jobs (bench tier), and in `test_profile_jobs`'s two-rank `varuna profile`
job on a host of one core, which checks that it leaves the run directory alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from varuna.profile.calibrate import _core_sharing, _solve, _SpinModel, shares_cores


def test_solve_finds_the_overhead_that_closes_the_gap() -> None:
    # 16 actions on the critical path, 100 ms without overhead, 108 ms measured: 0.5 ms each
    assert _solve(lambda c: 0.1 + 16 * c, 0.108) == pytest.approx(5e-4, abs=2e-6)
    # a nondecreasing prediction with a flat part and a jump still lands where it crosses
    stepwise = lambda c: 0.1 if c < 1e-3 else 0.1 + 20 * c  # noqa: E731
    assert _solve(stepwise, 0.125) == pytest.approx(1.25e-3, abs=2e-6)
    # more than the whole measured step per action: the search widens
    assert _solve(lambda c: 1e-3 + c / 100, 0.5) == pytest.approx(49.9, rel=1e-4)


def test_solve_never_goes_below_zero() -> None:
    """A prediction already at or above the measurement (the simulator's other terms overcharge a
    tiny model) charges nothing: an action cannot take negative time."""
    assert _solve(lambda c: 0.02 + c, 0.013) == 0.0
    assert _solve(lambda c: 0.013 + c, 0.013) == 0.0


def test_core_sharing_follows_the_cores_of_each_host() -> None:
    assert _core_sharing([("a", 2)] * 4) == {1: 1.0, 2: 1.0, 3: 1.5, 4: 2.0}
    assert _core_sharing([("a", 8)] * 4) == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}
    # two hosts of one core each: n busy ranks spread over both, half of them on each
    assert _core_sharing([("a", 1), ("a", 1), ("b", 1), ("b", 1)]) == {1: 1.0, 2: 1.0, 3: 1.5, 4: 2.0}


def test_the_cost_per_action_is_fitted_only_where_ranks_share_a_hosts_cores() -> None:
    assert shares_cores([("a", 2)] * 4)  # 4 ranks on 2 cores
    assert shares_cores([("a", 1), ("a", 1), ("b", 4)])  # one host oversubscribed is enough
    assert not shares_cores([("a", 2)] * 2)  # a core each
    assert not shares_cores([("a", 1), ("b", 1), ("c", 1)])  # one rank per one-core host
    assert not shares_cores([("a", 8)] * 4)
    assert not shares_cores([])


def test_the_spin_model_costs_the_cpu_time_it_is_given() -> None:
    import time

    import torch

    model = _SpinModel(2, forward_s=0.01, backward_s=0.02)
    x = torch.randn(3, 8)  # a batch: no gradient wanted, as at the first stage
    t0 = time.thread_time()
    loss = model(x)
    t1 = time.thread_time()
    loss.backward()
    t2 = time.thread_time()
    assert 0.02 <= t1 - t0 < 0.03 and 0.04 <= t2 - t1 < 0.05  # two blocks each way
    assert all(p.grad is not None for p in model.parameters())
    assert len(model.cuts) == 1 and sum(p.numel() for p in model.parameters()) == 2


def test_patched_environ_sets_removes_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from varuna._env import patched_environ

    monkeypatch.setenv("VARUNA_T_KEEP", "old")
    monkeypatch.delenv("VARUNA_T_NEW", raising=False)
    with patched_environ({"VARUNA_T_KEEP": None, "VARUNA_T_NEW": "1"}):
        assert "VARUNA_T_KEEP" not in os.environ and os.environ["VARUNA_T_NEW"] == "1"
        os.environ["VARUNA_T_NEW"] = "changed inside"
    assert os.environ["VARUNA_T_KEEP"] == "old" and "VARUNA_T_NEW" not in os.environ
    with pytest.raises(RuntimeError), patched_environ({"VARUNA_T_KEEP": "during"}):
        raise RuntimeError("the block fails")
    assert os.environ["VARUNA_T_KEEP"] == "old"  # put back on failure too


def test_the_calibration_pipeline_runs_the_real_engine_and_leaves_the_process_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank (a one-process group): the spin pipeline's step is at least its compute, and
    neither the RNG, the environment nor the working directory show that it ran."""
    import os

    import torch

    from varuna import Varuna
    from varuna.comm.rendezvous import init_distributed
    from varuna.profile.calibrate import _measure

    init_distributed()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VARUNA_TELEMETRY", "1")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    step = _measure(Varuna, 1, 3, 0.002, 0.004, 16, steps=2, warmup=1)
    assert 3 * 0.006 <= step < 1.0  # 3 micro-batches of a 2 ms forward and a 4 ms backward
    assert torch.equal(torch.get_rng_state(), state)
    assert os.environ["VARUNA_TELEMETRY"] == "1" and list(tmp_path.iterdir()) == []
