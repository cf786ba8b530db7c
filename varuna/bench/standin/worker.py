"""One rank of the stand-in bench: a transformers model cut by `auto_cut`, its stage's forward timed.

    varuna run --pipeline P -m varuna.bench.standin.worker SPEC OUT

`varuna.bench.standin.driver` starts it so. After two training steps, each rank runs its stage's
forward (the engine's own `_forward`: stand-ins before its input CutPoint, its own modules, stop at
its output CutPoint) `repeats` times on one micro-batch, with the stand-in timer on, and writes one
JSON record per model to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from varuna import Varuna, auto_cut
from varuna.cut import standin as standin


def build(kind: str, spec: dict[str, Any]) -> torch.nn.Module:
    import transformers

    d, blocks, seq = spec["d_model"], spec["blocks"], spec["seq_len"]
    small = {"vocab_size": spec["vocab"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if kind == "gpt2":
        config = transformers.GPT2Config(
            n_layer=blocks,
            n_embd=d,
            n_head=max(d // 64, 1),
            n_positions=seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **small,
        )
        return transformers.GPT2LMHeadModel(config)
    heads = max(d // 64, 2)
    llama = transformers.LlamaConfig(
        num_hidden_layers=blocks,
        hidden_size=d,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        intermediate_size=int(d * 8 / 3) // 8 * 8,
        max_position_embeddings=seq,
        tie_word_embeddings=True,
        **small,
    )
    return transformers.LlamaForCausalLM(llama)


def measure(kind: str, spec: dict[str, Any], pipeline: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build(kind, spec)
    auto_cut(model)
    per = spec["blocks"] // pipeline  # even blocks per stage: stage s ends after block (s+1)*per - 1
    boundaries = [(s + 1) * per - 1 for s in range(pipeline - 1)]
    mbs, seq = spec["micro_batch"], spec["seq_len"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, spec["vocab"], (2 * mbs, seq), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    engine = Varuna(
        model,
        pipeline=pipeline,
        data=1,
        global_batch_size=2 * mbs,
        micro_batch_size=mbs,
        partition=boundaries,
        example_batch=batch,
        schedule="1f1b",
    )
    for _ in range(2):
        engine.step(batch)
    runtime = engine._runtime
    runtime.micro = [{k: v[:mbs] for k, v in batch.items()}]
    inputs = None if engine.stage == 0 else torch.randn(mbs, seq, spec["d_model"], requires_grad=True)
    forward_s, standin_s = [], []
    standin.timer.enabled = True
    try:
        for _ in range(spec["repeats"] + 1):
            standin.timer.seconds = 0.0
            t0 = time.perf_counter()
            out = runtime._forward(runtime.chunks[engine.stage], 0, inputs, grad=True)
            forward_s.append(time.perf_counter() - t0)
            standin_s.append(standin.timer.seconds)
            del out
    finally:
        standin.timer.enabled = False
    forward, stand = statistics.median(forward_s[1:]), statistics.median(standin_s[1:])
    engine.close()
    return {
        "model": kind,
        "pipeline": pipeline,
        "stage": engine.stage,
        "forward_ms": forward * 1e3,
        "standin_ms": stand * 1e3,
        "own_ms": (forward - stand) * 1e3,
        "overhead": stand / max(forward - stand, 1e-12),
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    records = [measure(kind, spec, spec["pipeline"]) for kind in spec["models"]]
    rank = torch.distributed.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(records))


if __name__ == "__main__":
    main()
