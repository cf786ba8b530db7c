"""Evaluation through the pipeline (`Varuna.evaluate`), against the plain model's eval() loss.

    varuna run --pipeline W tests/scripts/eval_worker.py OUT W [TAG]

For each P x D of EVAL_CONFIGS[W] and each model (the GPT and BERT-MLM of varuna.models, with
dropout, and a transformers GPT-2): evaluate an evaluation set of EVAL_SAMPLES samples (its last
global batch partial) before and after one training step, with a metric summing tokens and
correct next-token predictions. OUT/<model>-<P>x<D>[-TAG]/rank<r>.pt holds both evaluations, the
first step's loss and whether the model is back in training mode.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import dataset, optimizer  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.data import collate  # noqa: E402
from varuna.models import GPT, BertMLM, bert_tiny, gpt_tiny  # noqa: E402

EVAL_SAMPLES, GLOBAL, MICRO = 37, 8, 2
EVAL_MODELS = ("gpt", "bert", "hf-gpt2")
EVAL_CONFIGS: dict[int, list[tuple[int, int, str]]] = {
    2: [(2, 1, "1f1b"), (2, 1, "interleaved-1f1b")],
    4: [(2, 2, "1f1b"), (4, 1, "varuna")],
}


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(1234)
    if kind == "gpt":
        return GPT(dataclasses.replace(gpt_tiny(), dropout=0.1))
    if kind == "bert":
        return BertMLM(dataclasses.replace(bert_tiny(), dropout=0.1))
    import transformers

    from varuna import auto_cut

    config = transformers.GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=2,
        n_positions=16,
        vocab_size=64,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    auto_cut(model)
    return model


def data(kind: str) -> Any:
    return dataset("gpt" if kind == "hf-gpt2" else kind)


def next_token_hits(outputs: Any, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Tokens and correct predictions of a language model's logits (a transformers output)."""
    logits = outputs.logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return {"tokens": float(labels.numel()), "correct": float((logits.argmax(-1) == labels).sum())}


def rows(kind: str) -> list[dict[str, torch.Tensor]]:
    ds = data(kind)
    return [ds[i] for i in range(100, 100 + EVAL_SAMPLES)]


if __name__ == "__main__":
    out, world = Path(sys.argv[1]), int(sys.argv[2])
    tag = f"-{sys.argv[3]}" if len(sys.argv) > 3 else ""
    for P, D, schedule in EVAL_CONFIGS[world]:
        for kind in EVAL_MODELS:
            if schedule == "interleaved-1f1b" and kind == "hf-gpt2":
                continue
            model = build(kind)
            train = data(kind)
            engine = Varuna(
                model,
                pipeline=P,
                data=D,
                global_batch_size=GLOBAL,
                micro_batch_size=MICRO,
                schedule=schedule,
                partition="uniform",  # the same cut in every job (a timed one varies, and dropout with it)
                example_batch=collate([train[0], train[1]]),
            )
            engine.set_optimizer(optimizer(engine.parameters()))
            metrics = next_token_hits if kind == "hf-gpt2" else None
            val = rows(kind)
            before = engine.evaluate(val, metrics=metrics)
            loss = engine.step(engine.batch(train, 0))
            after = engine.evaluate(
                iter([collate(val[i : i + GLOBAL]) for i in range(0, EVAL_SAMPLES, GLOBAL)])
            )
            second = engine.step(engine.batch(train, 1))
            record = {
                "before": dataclasses.asdict(before),
                "after": dataclasses.asdict(after),
                "losses": [loss, second],
                "training": model.training,
                "stage": engine.stage,
            }
            where = out / f"{kind}-{P}x{D}{'-' + schedule if schedule == 'interleaved-1f1b' else ''}{tag}"
            where.mkdir(parents=True, exist_ok=True)
            torch.save(record, where / f"rank{engine.rank}.pt")
            engine.close()
