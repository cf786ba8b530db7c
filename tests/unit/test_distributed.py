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


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from varuna.comm.rendezvous import shutdown

    if dist.is_initialized():  # an earlier test's group: init_distributed would just return it
        shutdown()
    for name, value in {
        "RANK": rank,
        "WORLD_SIZE": world,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("VARUNA_RENDEZVOUS_TIMEOUT_S", "1")


def test_rendezvous_gives_up_on_a_store_nobody_started(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from varuna.comm.rendezvous import init_distributed
    from varuna.errors import LaunchError
    from varuna.telemetry.events import free_port

    port = free_port()  # rank 0, which would serve the store here, never started
    _torchrun_env(monkeypatch, 1, 2, port)
    start = time.monotonic()
    with pytest.raises(
        LaunchError,
        match=rf"rank 1 could not reach the rendezvous store at 127.0.0.1:{port} "
        r"\(MASTER_ADDR:MASTER_PORT\) within 1 s: .*is rank 0 running",
    ):
        init_distributed()
    assert time.monotonic() - start < 30


def test_rendezvous_timeout_must_be_positive_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    from varuna.comm.rendezvous import _rendezvous_timeout_s

    for raw in ("0", "soon", "-5"):
        monkeypatch.setenv("VARUNA_RENDEZVOUS_TIMEOUT_S", raw)
        with pytest.raises(
            ConfigError, match=rf"VARUNA_RENDEZVOUS_TIMEOUT_S must be a number of seconds > 0 \(got '{raw}'\)"
        ):
            _rendezvous_timeout_s()


def test_a_torchrun_style_rank_0_still_meets_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from varuna.comm.rendezvous import init_distributed, shutdown
    from varuna.telemetry.events import free_port

    _torchrun_env(monkeypatch, 0, 1, free_port())
    try:
        assert init_distributed() == (0, 1)
        assert dist.get_world_size() == 1
    finally:
        shutdown()
