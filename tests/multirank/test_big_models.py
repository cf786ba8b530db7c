"""Models built on the meta device (`varuna.engine.materialize`), trained by the real engine.

Llama (rotary `inv_freq`, a non-persistent buffer no file holds) and GPT-2 (tied embeddings), built
under `torch.device("meta")` and cut by `auto_cut`: each rank makes only its stage real. Loaded with
`weights=` from a sharded folder that `save_pretrained` wrote of the plain model, at 2x1, 2x2 and
4x1 under two schedules, 5 AdamW steps equal plain training of the plain model from the same
weights. Without weights, at 2x1 and 4x1, every stage starts from exactly the values
`varuna.init_weights` gives the plain model (each module seeded by its name), then trains equal to
it. One job per world size (tests/scripts/meta_worker.py), both started at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _helpers import REPO, SCRIPTS, wait_job

import varuna

sys.path.insert(0, str(SCRIPTS))
from hf_common import CONFIGS, SHAPES, STEPS, build, reference  # noqa: E402
from meta_worker import META_MODELS, META_SCHEDULES  # noqa: E402

pytestmark = pytest.mark.multirank
TIMEOUT = 400


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, varuna_popen) -> Path:
    base = tmp_path_factory.mktemp("big-models")
    weights = base / "weights"
    for kind in META_MODELS:  # several shards each, with an index, as a real checkpoint has
        build(kind).save_pretrained(weights / kind, max_shard_size="20KB")
        assert (weights / kind / "model.safetensors.index.json").exists()
    out = base / "out"
    procs = {}
    for world in CONFIGS:
        log = base / f"w{world}.log"
        procs[world] = (
            varuna_popen(
                [SCRIPTS / "meta_worker.py", out, str(world), weights],
                pipeline=world,
                data=1,
                run_dir=base / f"run{world}",
                env={"TRANSFORMERS_VERBOSITY": "error"},
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                cwd=base,
            ),
            log,
        )
    for proc, log in procs.values():
        wait_job(proc, log, timeout=TIMEOUT)
    return out


def _ranks(path: Path) -> list[dict[str, object]]:
    files = sorted(path.glob("rank*.pt"))
    assert files, f"nothing saved in {path}"
    return [torch.load(f, weights_only=True) for f in files]


def _assert_equal_to(ranks: list[dict], losses: list[float], params: dict[str, torch.Tensor], P: int) -> None:
    assert {r["stage"] for r in ranks} == set(range(P))
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=name)
    assert {n for r in ranks for n in r["params"]} == set(params), "every parameter is held by some stage"


def _plain_init(kind: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = build(kind)
    return varuna.init_weights(model, seed=0)


@pytest.mark.parametrize("schedule", META_SCHEDULES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", META_MODELS)
def test_meta_model_with_sharded_weights_equals_plain_training(
    jobs: Path, kind: str, shape: tuple[int, int], schedule: str
) -> None:
    torch.set_num_threads(1)
    P, D = shape
    ranks = _ranks(jobs / f"{kind}-{P}x{D}-{schedule}")
    assert len(ranks) == P * D
    _assert_equal_to(ranks, *reference(kind, STEPS, model=build(kind)), P)


@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] == 1], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", META_MODELS)
def test_meta_model_default_init_equals_init_weights_at_any_split(
    jobs: Path, kind: str, shape: tuple[int, int]
) -> None:
    torch.set_num_threads(1)
    P, D = shape
    ranks = _ranks(jobs / f"{kind}-{P}x{D}-init")
    plain = _plain_init(kind)
    initial = {n: p.detach().clone() for n, p in plain.named_parameters()}
    for r in ranks:
        for name, value in r["before"].items():
            torch.testing.assert_close(value, initial[name], rtol=0, atol=0, msg=name)
    _assert_equal_to(ranks, *reference(kind, STEPS, model=plain), P)


def test_rotary_inv_freq_is_recomputed_not_left_unset(jobs: Path) -> None:
    """Every stage holds the rotary embedding (the model's glue before the layers): each one's
    inv_freq is the value the constructor computes, with weights= (no file holds it) and without."""
    want = dict(build("llama").named_buffers())["model.rotary_emb.inv_freq"]
    for tag in ("llama-4x1-1f1b", "llama-4x1-init", "llama-2x2-varuna"):
        for r in _ranks(jobs / tag):
            torch.testing.assert_close(r["buffers"]["model.rotary_emb.inv_freq"], want, rtol=0, atol=0)


def _doc_blocks() -> dict[str, str]:
    """docs/big-models.md's examples, by their marker (`<!-- docs example N: HOW -->`)."""
    text = (REPO / "docs" / "big-models.md").read_text()
    blocks = {}
    for part in text.split("<!-- docs example ")[1:]:
        how = part.split(" -->", 1)[0].split(": ", 1)[1]
        blocks[how + f" #{len(blocks) + 1}"] = part.split("```python\n", 1)[1].split("```", 1)[0]
    return blocks


def test_the_big_models_guide_runs_as_written(tmp_path: Path, varuna_run) -> None:
    """Write weights, train a meta-built Llama from them at P = 2, consolidate into shards that
    transformers loads: the guide's three examples, as a user runs them."""
    blocks = _doc_blocks()
    assert list(blocks) == ["python #1", "varuna run --pipeline 2 #2", "python #3"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    for name, code in blocks.items():
        script = tmp_path / f"example{name[-1]}.py"
        script.write_text(code)
        if name.startswith("varuna run"):
            done = varuna_run(
                [script], pipeline=2, run_dir=tmp_path / "runs" / "llama", cwd=tmp_path, timeout=200
            )
            assert "trained 3 steps, loss" in done.stdout
            assert "stage 0: " in done.stdout and "stage 1: " in done.stdout
        else:
            proc = subprocess.run(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
                stdin=subprocess.DEVNULL,
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list((tmp_path / "llama-weights").glob("model-*.safetensors"))) > 1
    shards = list((tmp_path / "llama-trained").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "llama-trained" / "config.json").exists()
    assert "loaded" in proc.stdout


def test_a_4x1_checkpoint_consolidates_into_shards_that_from_pretrained_loads(
    jobs: Path, tmp_path: Path
) -> None:
    import transformers

    ranks = _ranks(jobs / "llama-4x1-1f1b")
    trained = {n: v for r in ranks for n, v in r["params"].items()}
    out = varuna.consolidate(
        jobs / "llama-4x1-1f1b" / "checkpoints",
        tmp_path / "llama",
        config=build("llama").config,
        max_shard_size="20KB",
    )
    assert len(list(out.glob("model-*.safetensors"))) >= 3 and (out / "config.json").exists()
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), trained[name], rtol=0, atol=0, msg=name)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again, as the config says


def test_pipeline_auto_refuses_a_meta_model_without_a_profile(jobs: Path) -> None:
    messages = {p.read_text() for p in jobs.glob("auto-error-rank*.txt")}
    assert len(list(jobs.glob("auto-error-rank*.txt"))) == 2 and len(messages) == 1
    assert (
        "pipeline='auto' profiles the model in one process, but this model is on the meta device"
        in messages.pop()
    )
