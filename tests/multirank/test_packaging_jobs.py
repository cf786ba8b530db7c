"""`import varuna` in a fresh interpreter pulls in no notebook stack."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _helpers import REPO

pytestmark = pytest.mark.multirank
ROOT = REPO


def test_import_varuna_pulls_in_no_notebook_stack() -> None:

    code = "import sys, varuna; bad = [m for m in ('plotly', 'ipywidgets', 'IPython', 'jupyter_client') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
