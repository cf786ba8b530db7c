"""`Varuna.evaluate` equals the plain model's eval() loss, at 2x1, 2x2 and 4x1 (and two chunks per
rank), for the GPT and BERT-MLM of varuna.models and a transformers GPT-2, before and after a
training step; dropout is off while it evaluates and on again after; a metric is summed over every
micro-batch of every replica. One job per world size (tests/scripts/eval_worker.py), and one more
at 2x1 over the serial links (VARUNA_P2P=serial: the NCCL path's courier, replanned for evaluation).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _helpers import SCRIPTS, wait_job

sys.path.insert(0, str(SCRIPTS))
from eval_worker import EVAL_CONFIGS, EVAL_MODELS, GLOBAL, MICRO, build, next_token_hits, rows  # noqa: E402

from varuna.data import collate  # noqa: E402
from varuna.engine.evaluate import split  # noqa: E402

pytestmark = pytest.mark.multirank
TIMEOUT = 300
RUNS = [(P, D, s, kind) for world in EVAL_CONFIGS for P, D, s in EVAL_CONFIGS[world] for kind in EVAL_MODELS]
RUNS = [r for r in RUNS if not (r[2] == "interleaved-1f1b" and r[3] == "hf-gpt2")]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, varuna_popen) -> Path:
    base = tmp_path_factory.mktemp("evaluate")
    out = base / "out"
    launches = [(world, [], {}) for world in EVAL_CONFIGS] + [(2, ["serial"], {"VARUNA_P2P": "serial"})]
    procs = []
    for i, (world, extra, env) in enumerate(launches):
        log = base / f"job{i}.log"
        proc = varuna_popen(
            [SCRIPTS / "eval_worker.py", out, str(world), *extra],
            pipeline=world,
            run_dir=base / f"run{i}",
            env={"TRANSFORMERS_VERBOSITY": "error", **env},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            cwd=base,
        )
        procs.append((proc, log))
    for proc, log in procs:
        wait_job(proc, log, timeout=TIMEOUT)
    return out


def _reference(
    kind: str, P: int, D: int, model: torch.nn.Module, val: list
) -> tuple[float, dict[str, float]]:
    total, n, sums = 0.0, 0, {"tokens": 0.0, "correct": 0.0}
    with torch.no_grad():
        for start in range(0, len(val), GLOBAL):
            size = min(GLOBAL, len(val) - start)
            for replica in range(D):
                for r in split(size, D, replica, MICRO):
                    micro = collate(val[start + r.start : start + r.stop])
                    out = model(**micro)
                    loss = out.loss if hasattr(out, "loss") else out
                    total += float(loss) * len(r)
                    n += len(r)
                    if kind == "hf-gpt2":
                        for key, value in next_token_hits(out, micro).items():
                            sums[key] += value
    return total / n, sums


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[3]}-{r[0]}x{r[1]}-{r[2]}")
def test_evaluate_equals_the_plain_models_eval_loss(jobs: Path, run: tuple[int, int, str, str]) -> None:
    torch.set_num_threads(1)
    P, D, schedule, kind = run
    tag = f"{kind}-{P}x{D}{'-' + schedule if schedule == 'interleaved-1f1b' else ''}"
    ranks = [torch.load(f, weights_only=True) for f in sorted((jobs / tag).glob("rank*.pt"))]
    assert len(ranks) == P * D
    model = build(kind).eval()
    val = rows(kind)
    loss, sums = _reference(kind, P, D, model, val)
    for r in ranks:
        assert r["training"] is True  # back in training mode after evaluating
        assert r["before"]["samples"] == len(val)
        assert r["before"]["loss"] == pytest.approx(loss, rel=1e-6)
        if kind == "hf-gpt2":
            assert r["before"]["metrics"] == pytest.approx(sums, rel=0, abs=0)
        else:
            assert r["before"]["metrics"] == {}
        assert r["after"]["samples"] == len(val) and r["after"]["loss"] != r["before"]["loss"]
    assert len({(r["before"]["loss"], r["after"]["loss"]) for r in ranks}) == 1  # the same on every rank


def test_evaluate_over_serial_links_equals_the_early_receive_links(jobs: Path) -> None:
    for kind in EVAL_MODELS:
        early = [torch.load(f, weights_only=True) for f in sorted((jobs / f"{kind}-2x1").glob("rank*.pt"))]
        serial = [
            torch.load(f, weights_only=True) for f in sorted((jobs / f"{kind}-2x1-serial").glob("rank*.pt"))
        ]
        assert [r["before"] for r in serial] == [r["before"] for r in early]
        assert [r["losses"] for r in serial] == [r["losses"] for r in early]


def test_the_training_guide_example_runs_as_written(tmp_path: Path, varuna_run) -> None:
    """docs/training.md's example: train 4 steps at P = 2 with a JSON-lines logger, then evaluate."""
    from _helpers import REPO

    text = (REPO / "docs" / "training.md").read_text()
    code = text.split("<!-- docs example: varuna run --pipeline 2 -->", 1)[1].split("```python\n", 1)[1]
    script = tmp_path / "example.py"
    script.write_text(code.split("```", 1)[0])
    done = varuna_run([script], pipeline=2, run_dir=tmp_path / "run", cwd=tmp_path, timeout=150)
    assert "eval loss " in done.stdout and "over 37 samples" in done.stdout
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 4]
