"""Checkpoints written in the background (`checkpoint(blocking=False)`, `checkpoint_every`): the same
checkpoint as a blocking one, training going on meanwhile, at most one in flight, a failed write
raised in the training thread with the previous checkpoint still latest. One process; the multi-rank
path (the write's collectives on a group of their own) is in tests/multirank/test_checkpoint_jobs.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from _helpers import make_gpt_engine as make

from varuna.checkpoint import layout as ckpt
from varuna.checkpoint.config import CheckpointConfig
from varuna.errors import CheckpointError, ConfigError


def test_a_background_checkpoint_resumes_as_a_blocking_one(tmp_path: Path) -> None:
    a, data = make(tmp_path)
    for k in range(2):
        a.step(a.batch(data, k))
    path = a.checkpoint(blocking=False)
    assert path == tmp_path / "checkpoints" / "step-00000002"
    expected = [a.step(a.batch(data, k)) for k in (2, 3)]  # training goes on while it is written
    a.wait_checkpoint()  # (a step after the write ended has taken its record already)
    record = a.last_checkpoint
    assert record is not None and record["step"] == 2 and record["blocking"] is False
    assert record["bytes"] > 0 and 0 < record["copy_s"] <= record["seconds"]
    assert a.wait_checkpoint() is None  # nothing in flight now
    assert ckpt.latest(tmp_path / "checkpoints") == path
    b, _ = make(tmp_path, seed=99, resume=path)  # the state of step 2, not of a later step
    assert [b.step(b.batch(data, k)) for k in (2, 3)] == expected
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    a.close()
    b.close()


def test_checkpoint_every_steps_writes_in_the_background(tmp_path: Path) -> None:
    engine, data = make(tmp_path, checkpoint_every=2, checkpoint_keep=5)
    for k in range(5):
        engine.step(engine.batch(data, k))
    engine.close()  # waits for the last write
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step-00000002", "step-00000004"]
    assert engine.last_checkpoint is not None and engine.last_checkpoint["blocking"] is False


def test_checkpoint_every_seconds(tmp_path: Path) -> None:
    engine, data = make(tmp_path, checkpoint_every="0.05s")
    time.sleep(0.1)  # the time is up by the first step's end, however fast the step
    engine.step(engine.batch(data, 0))
    engine.wait_checkpoint()
    assert ckpt.latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step-00000001"
    engine.close()


def test_a_failed_background_write_raises_in_training_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, data = make(tmp_path)
    engine.step(engine.batch(data, 0))
    first = engine.checkpoint()

    def broken_commit(*args: object, **kwargs: object) -> int:
        raise CheckpointError("disk full (provoked)")

    monkeypatch.setattr(ckpt, "commit", broken_commit)
    engine.step(engine.batch(data, 1))
    engine.checkpoint(blocking=False)
    with pytest.raises(CheckpointError, match="disk full"):
        engine.wait_checkpoint()
    assert ckpt.latest(tmp_path / "checkpoints") == first
    monkeypatch.undo()
    engine.step(engine.batch(data, 2))  # nothing left in flight: training goes on
    assert engine.checkpoint(blocking=False) == tmp_path / "checkpoints" / "step-00000003"
    engine.close()
    assert ckpt.latest(tmp_path / "checkpoints") == tmp_path / "checkpoints" / "step-00000003"


def test_checkpoint_every_is_checked() -> None:
    assert CheckpointConfig(checkpoint_every="10min").every_s == 600.0
    assert CheckpointConfig(checkpoint_every=5).every_steps == 5
    for bad in ("often", "0s", "5 days"):
        with pytest.raises(ConfigError, match=r"checkpoint_every=.*'30s', '10min' or '1h'"):
            CheckpointConfig(checkpoint_every=bad)
    for bad in (0, True, 2.5):
        with pytest.raises(ConfigError, match=r"^checkpoint_every must be a number of steps"):
            CheckpointConfig(checkpoint_every=bad)  # type: ignore[arg-type]


def test_checkpoint_every_needs_a_run_directory() -> None:
    from varuna import Varuna
    from varuna.models import GPT, gpt_tiny

    with pytest.raises(ConfigError, match="checkpoint_every=2 needs a run directory"):
        Varuna(GPT(gpt_tiny()), pipeline=1, global_batch_size=4, micro_batch_size=2, checkpoint_every=2)
