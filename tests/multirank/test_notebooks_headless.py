"""The notebooks run headless (nbclient) with small settings (that they are committed
without outputs is checked in tests/unit/test_notebooks.py).

Each notebook runs in a copy of notebooks/ under tmp_path, so its runs/ never lands in the repo.
The quickstart asserts its own story (checkpoint on disk, a 2x2 -> 4x1 resize, stop, resume, every
step present once, no loss jump at a relaunch); the bubbles notebook asserts all three schedules
finished and measured a bubble; the transformers notebook trains a stock GPT-2 at 2x2, asserts the loss
fell, and generates from the consolidated weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from _helpers import REPO

from varuna._env import patched_environ

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = REPO / "notebooks"
pytestmark = pytest.mark.multirank


def execute(name: str, tmp_path: Path, timeout: int) -> nbformat.NotebookNode:
    work = tmp_path / "nb"
    shutil.copytree(NOTEBOOKS, work)
    nb = nbformat.read(work / name, as_version=4)
    env = {"VARUNA_NOTEBOOK_SMALL": "1", "OMP_NUM_THREADS": "1"}
    with patched_environ(env):  # the kernel inherits this process's environment
        client = nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(work)}}
        )
        client.execute()
    return nb


def stream_text(nb: nbformat.NotebookNode) -> str:
    return "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "stream"
    )


@pytest.mark.timeout(400)
def test_quickstart_runs_headless(tmp_path: Path) -> None:
    nb = execute("quickstart.ipynb", tmp_path, timeout=300)
    text = stream_text(nb)
    assert "checkpoint of step" in text and "running at 4x1" in text
    assert "2 relaunches" in text and "finished" in text
    checkpoints = list((tmp_path / "nb" / "runs").glob("quickstart-*/checkpoints/step-*"))
    assert len(checkpoints) >= 2


@pytest.mark.timeout(400)
def test_bubbles_runs_headless(tmp_path: Path) -> None:
    nb = execute("bubbles.ipynb", tmp_path, timeout=300)
    text = stream_text(nb)
    for schedule in ("gpipe", "1f1b", "eager-1f1b", "varuna"):
        assert f"{schedule}: finished" in text
        assert any(line.startswith(f"{schedule:10s} measured") for line in text.splitlines())


@pytest.mark.timeout(400)
def test_finetune_transformers_runs_headless(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    nb = execute("finetune_transformers.ipynb", tmp_path, timeout=300)
    text = stream_text(nb)
    assert "loss " in text and "generated: 'def __init__(self" in text
    assert list((tmp_path / "nb" / "runs").glob("finetune-*/trained/model.safetensors"))
