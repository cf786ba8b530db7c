"""The notebooks are committed without outputs (they run headless in tests/multirank)."""

from __future__ import annotations

import pytest
from _helpers import REPO

nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = REPO / "notebooks"


@pytest.mark.parametrize("name", ["quickstart.ipynb", "bubbles.ipynb", "finetune_transformers.ipynb"])
def test_committed_without_outputs(name: str) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
