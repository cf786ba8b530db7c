"""`varuna.consolidate`: a checkpoint saved at 2x2 becomes the plain model's state dict, exactly.

One `varuna run` job (module-scoped) trains `GPTExtras` (a tiny GPT with tied embeddings, an alias
of a parameter only stage 1 holds, and buffers on both stages) for 3 steps and checkpoints; the
tests consolidate it in this process, and damage copies of it for the errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _helpers import SCRIPTS

import varuna
from varuna import cli
from varuna.errors import CheckpointError

sys.path.insert(0, str(SCRIPTS))


def test_a_missing_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint .*nowhere does not exist; give a step directory"):
        varuna.consolidate(tmp_path / "nowhere", tmp_path / "x.safetensors")


def test_a_directory_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(
        CheckpointError, match=r"holds no checkpoint \(no manifest.json, latest or checkpoints/latest\)"
    ):
        varuna.consolidate(tmp_path, tmp_path / "x.safetensors")


def test_out_must_not_be_a_directory(tmp_path: Path) -> None:
    step = tmp_path / "step-00000001"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    with pytest.raises(
        CheckpointError, match=r"is a directory; give the file to write, e.g. .*model.safetensors"
    ):
        varuna.consolidate(step, tmp_path)


def test_cli_prints_one_line_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["consolidate", str(tmp_path / "nowhere"), str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("varuna: error: checkpoint ") and "does not exist" in err and err.count("\n") == 1
