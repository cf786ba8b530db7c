"""Committing checkpoints: `latest` confined to checkpoints/ and falling back when damaged, retention
that keeps what was just committed, an atomic re-save, and a full disk (a real ENOSPC from /dev/full)
failing the save with the previous checkpoint intact and nothing left behind. One process (gloo,
world size 1); the two-rank full disk is in tests/multirank/test_checkpoint_jobs.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from _helpers import make_gpt_engine as make

from varuna.checkpoint import _commit
from varuna.checkpoint import layout as ckpt
from varuna.checkpoint import storage as cio
from varuna.errors import CheckpointError


@pytest.fixture()
def two(tmp_path: Path) -> Path:
    """A run directory with step-00000001 and step-00000002 (latest)."""
    engine, data = make(tmp_path)
    for k in range(2):
        engine.step(engine.batch(data, k))
        engine.checkpoint()
    engine.close()
    return tmp_path


def _resolve(run: Path) -> Path | None:
    return ckpt.resolve("latest", run)


@pytest.mark.parametrize("pointer", ["../../outside", "/tmp", "step-00000002/../../x", "step-2", ""])
def test_latest_naming_anything_but_a_step_directory_falls_back(two: Path, pointer: str) -> None:
    (two / "checkpoints" / "latest").write_text(pointer + "\n")
    with pytest.warns(
        UserWarning,
        match=r"latest is unusable \(.*not a checkpoint directory inside .*step-00000002, instead",
    ):
        assert _resolve(two) == two / "checkpoints" / "step-00000002"


def test_symlinks_leaving_checkpoints_are_not_followed(
    two: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = two / "checkpoints"
    outside = tmp_path_factory.mktemp("elsewhere") / "step-00000009"
    shutil.copytree(root / "step-00000002", outside)  # a complete checkpoint, but not this run's
    (root / "step-00000009").symlink_to(outside)
    (root / "latest").write_text("step-00000009\n")
    assert ckpt.checkpoint_names(root) == ["step-00000001", "step-00000002"]
    with pytest.warns(UserWarning, match=r"names step-00000009, which is a symbolic link"):
        assert _resolve(two) == root / "step-00000002"
    (root / "latest").unlink()
    (root / "latest").symlink_to(outside.parent / "pointer")
    (outside.parent / "pointer").write_text("step-00000001\n")
    with pytest.warns(UserWarning, match=r"latest is not a file"):
        assert _resolve(two) == root / "step-00000002"


@pytest.mark.parametrize("damage", ["missing", "truncated", "uncommitted"])
def test_damaged_latest_falls_back_to_the_newest_valid_checkpoint(two: Path, damage: str) -> None:
    root = two / "checkpoints"
    victim = root / "step-00000002"
    if damage == "missing":
        shutil.rmtree(victim)
    elif damage == "truncated":
        data = next(victim.glob("*.distcp"))
        os.truncate(data, data.stat().st_size - 1)
    else:
        (victim / "manifest.json").unlink()
    with pytest.warns(
        UserWarning, match=r"step-00000002.*; resuming from the newest complete checkpoint, .*step-00000001"
    ):
        engine, _ = make(two, resume="latest")
    assert engine.step_count == 1
    engine.close()


def test_no_valid_checkpoint_at_all_is_an_error(two: Path) -> None:
    root = two / "checkpoints"
    for name in ("step-00000001", "step-00000002"):
        (root / name / "manifest.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"no other checkpoint in .* is complete. Resume from a checkpoint directory"
    ):
        _resolve(two)


def test_retention_keeps_the_checkpoint_just_committed(tmp_path: Path) -> None:
    """Resume from an older checkpoint while newer ones exist, then save: the new one stays, latest names it."""
    engine, data = make(tmp_path, checkpoint_keep=3)
    for k in range(4):
        engine.step(engine.batch(data, k))
        if k != 1:
            engine.checkpoint()  # steps 1, 3, 4
    engine.close()
    root = tmp_path / "checkpoints"
    assert ckpt.checkpoint_names(root) == ["step-00000001", "step-00000003", "step-00000004"]
    engine, data = make(tmp_path, resume=root / "step-00000001", checkpoint_keep=2)
    engine.step(engine.batch(data, 1))
    engine.checkpoint()  # step 2: kept with the newest other, 4
    assert ckpt.checkpoint_names(root) == ["step-00000002", "step-00000004"]
    assert (root / "latest").read_text().strip() == "step-00000002"
    engine.close()
    resumed, _ = make(tmp_path, resume="latest")
    assert resumed.step_count == 2
    resumed.close()


@pytest.mark.parametrize("swap", [True, False], ids=["rename-exchange", "rename-aside"])
def test_resaving_a_step_replaces_it_and_latest_never_dangles(
    two: Path, monkeypatch: pytest.MonkeyPatch, swap: bool
) -> None:
    root = two / "checkpoints"
    if not swap:
        monkeypatch.setattr(_commit, "_renameat2", None)  # a file system without RENAME_EXCHANGE
    seen: list[str] = []
    real_replace = os.replace

    def watched(src, dst) -> None:  # every rename of the commit: is latest usable right after it?
        real_replace(src, dst)
        name = (root / "latest").read_text().strip()
        seen.append(f"{Path(dst).name}:{(root / name / 'manifest.json').exists()}")

    engine, data = make(two, resume="latest")
    with torch.no_grad():
        first = next(engine.parameters())
        first.add_(1.0)
    monkeypatch.setattr(os, "replace", watched)
    engine.checkpoint()  # step 2 again, other weights
    monkeypatch.undo()
    if swap:
        assert seen == ["latest:True"]  # the directories swapped in renameat2, which os.replace never saw
    else:
        assert seen[-1] == "latest:True"  # here a window without step-00000002 exists (documented)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    stored = ckpt.stored_tensors(root / "step-00000002")
    key = next(k for k in stored if k.startswith("model."))
    got = {key: torch.empty(stored[key][0], dtype=stored[key][1])}
    ckpt.load_tensors(root / "step-00000002", got)
    assert torch.equal(got[key], dict(("model." + n, p) for n, p in engine.named_parameters())[key])
    ckpt.verify(root / "step-00000002", deep=True)
    engine.close()


@pytest.mark.parametrize("full", ["__0_0.distcp", "metadata.json", "extra.json", "../.latest.tmp"])
def test_a_full_disk_fails_the_save_and_leaves_nothing(
    two: Path, monkeypatch: pytest.MonkeyPatch, full: str
) -> None:
    """The file `full` is made a link to /dev/full before it is written: the kernel's own ENOSPC."""
    root = two / "checkpoints"
    real_write = cio.Writer.write_data

    def write_to_full_disk(self, plan, planner):
        (Path(self.path) / full).symlink_to("/dev/full")
        return real_write(self, plan, planner)

    monkeypatch.setattr(cio.Writer, "write_data", write_to_full_disk)
    engine, data = make(two, resume="latest")
    engine.step(engine.batch(data, 2))
    name = Path(full).name
    with pytest.raises(
        CheckpointError,
        match=rf"{name} could not be written: No space left on device \(ENOSPC\); the disk is full: free space "
        r"there or lower checkpoint_keep. The checkpoint was not committed",
    ):
        engine.checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    assert _resolve(two) == root / "step-00000002"
    ckpt.verify(root / "step-00000002", deep=True)
    monkeypatch.undo()
    engine.checkpoint()  # space again: the next save goes through
    assert (root / "latest").read_text().strip() == "step-00000003"
    engine.close()
