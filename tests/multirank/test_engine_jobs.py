"""A user error in a 2-rank job surfaces with its traceback, rank and stage."""

from __future__ import annotations

import pytest
from _helpers import SCRIPTS

pytestmark = pytest.mark.multirank


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_user_error_surfaces_with_its_traceback_rank_and_stage(tmp_path, varuna_run) -> None:
    out = varuna_run(
        [SCRIPTS / "engine_user_error.py"],
        pipeline=2,
        data=1,
        run_dir=tmp_path / "run",
        cwd=tmp_path,
        timeout=100,
        check=False,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    # the user's own frame and message, not a wrapper's
    assert 'engine_user_error.py", line' in text and "in forward" in text
    assert "ValueError: a bug in the user's block 3" in text
    assert "varuna: raised on rank 1 (stage 1, replica 0) while running action 1F0" in text
    assert "varuna: rank 1 (stage 1, replica 0) failed: ValueError: a bug in the user's block 3" in text
