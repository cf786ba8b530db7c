"""A NaN or Inf in a 2-stage pipeline (fp32 and bf16): every rank raises the same NonFiniteError,
naming the stage and module where it first appeared (tests/scripts/nonfinite_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _helpers import SCRIPTS

pytestmark = [pytest.mark.multirank, pytest.mark.timeout(180)]


def test_every_rank_names_the_stage_where_the_inf_appeared(tmp_path: Path, varuna_run) -> None:
    varuna_run(
        [SCRIPTS / "nonfinite_train.py", tmp_path / "out"], pipeline=2, run_dir=tmp_path / "run", timeout=150
    )
    for precision in ("fp32", "bf16"):
        messages = {(tmp_path / "out" / f"{precision}-rank{r}.txt").read_text() for r in (0, 1)}
        assert len(messages) == 1, messages
        message = messages.pop()
        assert message.startswith("step 1: the loss is nan"), message
        assert (
            "it first appears in the forward of stage 1 (rank 1), micro-batch 0, at module 'blocks.3', "
            "whose inputs were finite. Nothing was updated." in message
        ), message
