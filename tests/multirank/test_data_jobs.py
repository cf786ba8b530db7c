"""The open data path in real jobs: an iterable dataset across a morph, and docs/data.md as written.

Stream: 6 steps at 2x2 reading an IterableDataset through `engine.batches` (a prefetch thread),
a SIGUSR1 after step 3, resumed at 4x1 from the checkpoint: every sample of the 6 global batches
is trained exactly once, by one replica, at the step the stream rule gives it, and the losses equal
plain training on the same samples. Guide: docs/data.md's numbered examples run as a user runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import REPO, SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from transparency_common import GLOBAL_BATCH, reference  # noqa: E402

pytestmark = pytest.mark.multirank
STEPS, MORPH_AT = 6, 3


def _records(out: Path, pattern: str) -> list[dict]:
    return [json.loads(line) for path in sorted(out.glob(pattern)) for line in path.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_stream_morphed_from_2x2_to_4x1_trains_every_sample_once(tmp_path: Path, varuna_run) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    queued = subprocess.run(
        [sys.executable, "-m", "varuna", "resize", str(run), "-p", "4", "-d", "1", "--no-signal"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert queued.returncode == 0, queued.stderr
    job = varuna_run(
        [SCRIPTS / "data_stream_train.py", out, str(STEPS), str(MORPH_AT)],
        pipeline=2,
        data=2,
        run_dir=run,
        flags=["--elastic"],
        cwd=tmp_path,
        timeout=280,
    )
    assert "morphing 2x2 -> 4x1" in job.stdout + job.stderr
    records = _records(out, "ids-rank*.jsonl")
    shapes = {r["step"]: r["shape"] for r in records}
    assert shapes == {s: "2x2" if s < MORPH_AT else "4x1" for s in range(STEPS)}
    for step in range(STEPS):
        at = [r for r in records if r["step"] == step]
        assert len(at) == 4, at  # each rank trained each step once: none repeated, none lost
        by_replica: dict[int, list[int]] = {}
        for r in at:  # every stage of a replica reads the same share
            assert by_replica.setdefault(r["replica"], r["ids"]) == r["ids"], (step, r)
        shares = [by_replica[k] for k in sorted(by_replica)]
        assert sum(shares, []) == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
    losses = _records(out, "losses.jsonl")
    assert [r["step"] for r in losses] == list(range(STEPS))
    ref_losses, _ = reference("gpt", steps=STEPS)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in losses]), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )


def _doc_blocks() -> dict[str, str]:
    """docs/data.md's examples, by their marker (`<!-- docs example N: HOW -->`)."""
    text = (REPO / "docs" / "data.md").read_text()
    blocks = {}
    for part in text.split("<!-- docs example ")[1:]:
        number, how = part.split(" -->", 1)[0].split(": ", 1)
        blocks[f"{how} #{number}"] = part.split("```python\n", 1)[1].split("```", 1)[0]
    return blocks


@pytest.mark.timeout(300)
def test_the_data_guide_runs_as_written(tmp_path: Path, varuna_run) -> None:
    """The sampling rule, the stream rule and the Hugging Face recipe: the guide's Python examples in
    order in one process (text, tokenizer, packing), then its padding example as a 2-stage job."""
    pytest.importorskip("datasets")
    pytest.importorskip("transformers")
    blocks = _doc_blocks()
    assert list(blocks) == ["python #1", "python #2", "python #3", "varuna run --pipeline 2 #4", "python #5"]
    quiet = {"TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    script = tmp_path / "examples.py"
    script.write_text("\n\n".join(code for name, code in blocks.items() if name.startswith("python")))
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **quiet),
        capture_output=True,
        text=True,
        timeout=200,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "D=4: step 3 reads" in proc.stdout
    assert "replica 1 of 2, step 5: [44, 45, 46, 47]" in proc.stdout
    assert "400 lines, 300 tokens in the vocabulary" in proc.stdout
    assert "trained 6 steps" in proc.stdout.split("packed: ", 1)[1]
    train = tmp_path / "train_padded.py"
    train.write_text(blocks["varuna run --pipeline 2 #4"])
    done = varuna_run(
        [train], pipeline=2, run_dir=tmp_path / "runs" / "padded", cwd=tmp_path, env=quiet, timeout=200
    )
    assert "padded: trained 6 steps, loss" in done.stdout
