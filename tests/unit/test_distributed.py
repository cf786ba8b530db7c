"""Tests of varuna/distributed.py: placement, the launch environment, the one-process rendezvous."""

from __future__ import annotations

from pathlib import Path

import pytest

from varuna.comm.rendezvous import LaunchEnv, env_rank, launch_env, placement
from varuna.errors import ConfigError


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
