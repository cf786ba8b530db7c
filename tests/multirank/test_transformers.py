"""Unmodified transformers models, cut by `auto_cut`, trained by the real engine (`varuna run`).

GPT-2 (tied embeddings), BERT masked-LM (tied decoder, padding on part of the batch) and Llama
(tied embeddings, grouped-query attention) at 2x1, 2x2 and 4x1, every schedule once per model, and
DeBERTa-v2 and Mixtral at 2x1,
5 AdamW steps: the losses and final parameters equal plain training on the same micro-batches
(fp32, dropout 0). With dropout, the recomputing `varuna` schedule gives 1F1B's losses. A GPT-2
loaded with `from_pretrained` trains at P = 2. A loss on a value another stage computes is a
`PartitionError` naming the module and the CutPoint.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import varuna.schedule

pytest.importorskip("transformers")

from _helpers import REPO as ROOT
from _helpers import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
from hf_common import (  # noqa: E402
    CHUNK_RUNS,
    CONFIGS,
    MODELS,
    MORE_MODELS,
    SHAPES,
    STEPS,
    build,
    reference,
    schedule_for,
)

pytestmark = pytest.mark.multirank
TIMEOUT = 420


def _readme_block() -> str:
    """docs/transformers.md's "Train a transformers model" code (it was the README's), as the user copies it."""
    text = (ROOT / "docs" / "transformers.md").read_text()
    marker = "<!-- docs example: tests/multirank/test_transformers.py runs this block as a 2x2 job -->"
    start = text.index(marker)
    return text[start:].split("```python\n", 1)[1].split("```", 1)[0]


def _launch(
    varuna_popen, world: int, script: str, args: list[str], run_dir: Path, log: Path, data: int = 1
) -> subprocess.Popen[bytes]:
    return varuna_popen(
        [SCRIPTS / script, *args],
        pipeline=world // data,
        data=data,
        run_dir=run_dir,
        env={"TRANSFORMERS_VERBOSITY": "error"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        cwd=run_dir.parent,
    )


def _wait(proc: subprocess.Popen[bytes], log: Path) -> tuple[int | str, str]:
    try:
        code: int | str = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "timeout"
    return code, log.read_text()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, varuna_popen) -> dict[str, object]:
    """The two training jobs (world 2 and 4) and the misuse job, started at once."""
    base = tmp_path_factory.mktemp("transformers")
    pretrained = base / "pretrained"
    build("gpt2", seed=4321).save_pretrained(pretrained)
    out = base / "out"
    procs = {
        world: _launch(
            varuna_popen,
            world,
            "transformers_worker.py",
            [str(out), str(world), str(pretrained)],
            base / f"run{world}",
            base / f"w{world}.log",
        )
        for world in CONFIGS
    }
    procs["misuse"] = _launch(
        varuna_popen, 2, "transformers_misuse.py", [], base / "misuse", base / "misuse.log"
    )
    readme = base / "train_hf.py"
    readme.write_text(_readme_block())
    procs["readme"] = _launch(varuna_popen, 4, str(readme), [], base / "readme", base / "readme.log", data=2)
    logs = {key: base / (f"w{key}.log" if isinstance(key, int) else f"{key}.log") for key in procs}
    results = {key: _wait(proc, logs[key]) for key, proc in procs.items()}
    for world in CONFIGS:
        code, text = results[world]
        assert code == 0, f"world {world} job failed ({code}):\n{text[-6000:]}"
    return {"out": out, "pretrained": pretrained, "misuse": results["misuse"], "readme": results["readme"]}


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    torch.set_num_threads(1)
    return {kind: reference(kind) for kind in MODELS}


def _ranks(path: Path) -> list[dict[str, object]]:
    files = sorted(path.glob("rank*.pt"))
    assert files, f"nothing saved in {path}"
    return [torch.load(f, weights_only=True) for f in files]


def _assert_equal_to(
    ranks: list[dict[str, object]], losses: list[float], params: dict[str, torch.Tensor]
) -> None:
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, rel=1e-5)
        for name, value in r["params"].items():  # type: ignore[union-attr]
            torch.testing.assert_close(value, params[name], rtol=1e-5, atol=1e-6, msg=name)
    held = {n for r in ranks for n in r["params"]}  # type: ignore[union-attr]
    assert held == set(params), "every parameter is held by some stage"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", MODELS)
def test_equal_to_plain_training(
    jobs: dict[str, object], references: dict, kind: str, shape: tuple[int, int]
) -> None:
    P, D = shape
    ranks = _ranks(jobs["out"] / f"{kind}-{P}x{D}")  # type: ignore[operator]
    assert len(ranks) == P * D and {r["stage"] for r in ranks} == set(range(P))
    _assert_equal_to(ranks, *references[kind])


@pytest.mark.parametrize("kind", MORE_MODELS)
def test_more_families_equal_plain_training_at_2x1(jobs: dict[str, object], kind: str) -> None:
    """DeBERTa-v2: a weight shared by every layer off the input path (the split backward keeps the
    graph for it). Mixtral: expert routing the meta device cannot run (the trace's shapes serve)."""
    _assert_equal_to(_ranks(jobs["out"] / f"{kind}-2x1"), *reference(kind))  # type: ignore[operator]


@pytest.mark.parametrize(("kind", "schedule"), CHUNK_RUNS, ids=[f"{k}-{s}" for k, s in CHUNK_RUNS])
def test_two_chunks_per_rank_equal_plain_training(
    jobs: dict[str, object], references: dict, kind: str, schedule: str
) -> None:
    """interleaved-1f1b / zb-v on a model cut by auto_cut: 4 virtual stages on 2 ranks."""
    _assert_equal_to(_ranks(jobs["out"] / f"{kind}-2x1-{schedule}"), *references[kind])  # type: ignore[operator]


def test_every_schedule_runs_and_every_model_runs_three() -> None:
    from hf_common import SCHEDULES

    assert set(SCHEDULES) | {s for _, s in CHUNK_RUNS} == set(varuna.schedule.SCHEDULES)
    assert {schedule_for(kind, s) for kind in MODELS for s in SHAPES} == set(SCHEDULES)
    for kind in MODELS:
        assert len({schedule_for(kind, s) for s in SHAPES}) == 3


def test_dropout_recomputing_schedule_equals_1f1b(jobs: dict[str, object]) -> None:
    out = jobs["out"]
    one_f_one_b, varuna = (_ranks(out / f"dropout-{s}") for s in ("1f1b", "varuna"))  # type: ignore[operator]
    plain = reference("gpt2")[0]
    for a, b in zip(one_f_one_b, varuna):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        # dropout is on: not the dropout-0 losses (which agree to 1e-6)
        assert max(abs(x - y) for x, y in zip(a["losses"], plain)) > 1e-4


def test_pretrained_weights_train_at_p2(jobs: dict[str, object]) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(jobs["pretrained"])
    model.train()
    ranks = _ranks(jobs["out"] / "pretrained")  # type: ignore[operator]
    losses, params = reference("gpt2", model=model)
    _assert_equal_to(ranks, losses, params)
    assert len(ranks[0]["losses"]) == STEPS


def test_a_loss_on_another_stages_value_is_a_partition_error(jobs: dict[str, object]) -> None:
    code, text = jobs["misuse"]  # type: ignore[misc]
    assert code not in (0, "timeout"), text[-3000:]
    assert "PartitionError: on stage 1, the loss uses the output of module 'lm.transformer.h.0'" in text, (
        text[-3000:]
    )
    assert "CutPoint 'lm.transformer.varuna_cuts.1'" in text


def test_a_2x2_checkpoint_consolidates_into_the_plain_model(jobs: dict[str, object], tmp_path: Path) -> None:
    import transformers
    from safetensors.torch import load_file

    from varuna import CheckpointError, consolidate

    tag = jobs["out"] / "gpt2-2x2"  # type: ignore[operator]
    out = consolidate(tag / "checkpoints", tmp_path / "gpt2.safetensors", model=build("gpt2"))
    plain = build("gpt2", seed=0)
    plain.load_state_dict(load_file(out), strict=True)
    trained = {n: v for r in _ranks(tag) for n, v in r["params"].items()}  # type: ignore[union-attr]
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), trained[name]), name
    assert torch.equal(plain.lm_head.weight, plain.transformer.wte.weight)  # still tied
    plain.save_pretrained(tmp_path / "hf")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for (name, a), b in zip(plain.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match=r"(?s)does not fit.*BertForMaskedLM"):
        consolidate(tag / "checkpoints", tmp_path / "x.safetensors", model=build("bert"))


def test_the_readme_example_trains_at_2x2(jobs: dict[str, object]) -> None:
    code, text = jobs["readme"]  # type: ignore[misc]
    assert code == 0, text[-4000:]
    losses = [float(line.rsplit("loss ", 1)[1]) for line in text.splitlines() if ": loss " in line]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5
    run = next(iter(jobs["out"].parent.glob("readme")))  # type: ignore[union-attr]
    assert list(run.glob("checkpoints/step-00000010"))


@pytest.mark.timeout(200)
def test_hugging_face_gradient_checkpointing_trains_equal_to_plain_at_2x1(tmp_path: Path, varuna_run) -> None:
    """`gradient_checkpointing_enable()` (torch.utils.checkpoint inside each block) under the
    pipeline: the same losses and parameters as plain training without it, each block recomputed
    once per micro-batch (a split backward would recompute it for each half: the engine turns the
    split off for such a model)."""
    varuna_run(
        [SCRIPTS / "hf_checkpointing_train.py", tmp_path / "out"],
        pipeline=2,
        run_dir=tmp_path / "run",
        env={"TRANSFORMERS_VERBOSITY": "error"},
        timeout=180,
    )
    ranks = [torch.load(f, weights_only=True) for f in sorted((tmp_path / "out").glob("rank*.pt"))]
    assert len(ranks) == 2
    for r in ranks:  # a block's attention ran twice per micro-batch: its forward, and again in the backward
        assert r["block_calls"] == 2 * r["forwards"], r["block_calls"]
    torch.set_num_threads(1)
    _assert_equal_to(ranks, *reference("gpt2"))
