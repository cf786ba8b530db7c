"""Tests of varuna/distributed.py: placement, the launch environment, the one-process rendezvous."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from varuna.comm.rendezvous import LaunchEnv, env_rank, launch_env, placement
from varuna.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("rank", "pipeline", "expected"),
    [
        (0, 1, (0, 0)),
        (3, 1, (0, 3)),
        (0, 2, (0, 0)),
        (1, 2, (1, 0)),
        (2, 2, (0, 1)),
        (3, 2, (1, 1)),
        (5, 3, (2, 1)),
        (6, 3, (0, 2)),
    ],
)
def test_placement_table(rank: int, pipeline: int, expected: tuple[int, int]) -> None:
    assert placement(rank, pipeline) == expected
    stage, replica = expected
    assert replica * pipeline + stage == rank


def test_placement_rejects_bad_input() -> None:
    with pytest.raises(ConfigError, match=r"pipeline depth must be >= 1 \(got 0\)"):
        placement(0, 0)
    with pytest.raises(ConfigError, match=r"rank must be >= 0 \(got -1\)"):
        placement(-1, 2)


def test_launch_env_reads_varuna_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("VARUNA_PIPELINE", "VARUNA_DATA", "VARUNA_RUN_DIR", "VARUNA_LAUNCHED"):
        monkeypatch.delenv(name, raising=False)
    assert launch_env() == LaunchEnv(pipeline=None, data=None, run_dir=None, launched=False)
    monkeypatch.setenv("VARUNA_PIPELINE", "4")
    monkeypatch.setenv("VARUNA_DATA", "2")
    monkeypatch.setenv("VARUNA_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("VARUNA_LAUNCHED", "1")
    assert launch_env() == LaunchEnv(pipeline=4, data=2, run_dir=tmp_path, launched=True)
    monkeypatch.setenv("VARUNA_DATA", "two")
    with pytest.raises(ConfigError, match=r"VARUNA_DATA must be a positive integer \(got 'two'\)"):
        launch_env()
    monkeypatch.setenv("VARUNA_DATA", "0")
    with pytest.raises(ConfigError, match=r"VARUNA_DATA must be a positive integer \(got 0\)"):
        launch_env()


def test_env_rank_prefers_the_process_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert env_rank() is None
    monkeypatch.setenv("RANK", "5")
    assert env_rank() == 5
    monkeypatch.setenv("PMI_RANK", "3")
    assert env_rank() == 3


@pytest.mark.timeout(120)
def test_init_distributed_single_process_without_mpi() -> None:
    """A plain `python script.py` gets a world of one on loopback and never loads MPI."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import torch.distributed as dist
        import varuna.comm.rendezvous as vd
        assert "mpi4py" not in sys.modules, "importing varuna.comm.rendezvous loaded mpi4py"
        assert vd.init_distributed(timeout_s=30) == (0, 1)
        assert vd.init_distributed() == (0, 1)  # idempotent
        assert dist.get_backend() == "gloo"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert "mpi4py" not in sys.modules, "the one-process path loaded mpi4py"
        vd.shutdown()
        vd.shutdown()
        assert not dist.is_initialized()
        print("ok", t.tolist())
        """
    )
    marker_vars = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK")
    env = {k: v for k, v in os.environ.items() if k not in marker_vars}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok [1.0, 1.0, 1.0]"
