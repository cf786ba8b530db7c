"""A Llama-style model of ~0.5B parameters (1.9 GiB of fp32 weights), built on the meta device and
trained with `weights=` from a sharded safetensors folder, each rank in a memory cgroup of its own.

    varuna run --pipeline P tests/scripts/big_llama_worker.py OUT WEIGHTS CGROUP_PREFIX

Before anything else the rank moves itself into the memory cgroup CGROUP_PREFIX-rank<r> (made by
the test with a limit smaller than the whole model), so the limit binds everything it allocates and
the engine's memory check reads it. It records its resident memory before the model is built
(baseline) and its peak after two SGD steps, its stage's parameter bytes and the engine's estimate,
in OUT/rank<r>.json.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RANK = int(
    next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if v in os.environ), 0)
)
if __name__ == "__main__":
    Path(f"{sys.argv[3]}-rank{RANK}", "cgroup.procs").write_text(str(os.getpid()))

import json  # noqa: E402

import torch  # noqa: E402

from varuna import Varuna, auto_cut  # noqa: E402

SEQ, STEPS = 16, 2


def config() -> object:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def status(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(out: Path, weights: Path) -> None:
    import transformers

    baseline = status("VmRSS")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config())
    auto_cut(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (4, SEQ), generator=g)
    batch = {"input_ids": ids, "labels": ids}
    engine = Varuna(
        model,
        global_batch_size=4,
        micro_batch_size=1,
        example_batch=batch,
        weights=weights,
        optimizer_state="none",
    )
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=1e-3))
    losses = [
        engine.step(engine.batch([{"input_ids": r, "labels": r} for r in ids], k)) for k in range(STEPS)
    ]
    record = {
        "rank": engine.rank,
        "stage": engine.stage,
        "losses": losses,
        "baseline": baseline,
        "peak": status("VmHWM"),
        "stage_param_bytes": sum(p.numel() * p.element_size() for p in engine.parameters()),
        "estimate": engine.memory_estimate.to_json(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{engine.rank}.json").write_text(json.dumps(record))
    engine.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
