"""One rank of the memory benchmark: a Llama built on the meta device, this rank's stage made real.

    varuna run --pipeline P -m varuna.bench.memory.worker SPEC.json

SPEC.json (written by `varuna.bench.memory.driver`) names the system, the
`transformers.LlamaConfig`, the weights folder (or none: the engine's seeded init), the batch shape,
the steps and the output folder. Every rank measures the same way, whatever the system:

    imports, torch.distributed up          (the process as any rank has it before the model)
    gc, malloc_trim, VmHWM reset           baseline = VmRSS
    meta model -> this stage real -> weights read
                                           built peak = VmHWM (the most while the stage was made)
    `steps` SGD steps                      peak = VmHWM (the most since the reset)

and writes OUT/rank<r>.json. The systems:

    varuna   `Varuna(model, weights=FOLDER, optimizer_state="none")` on the meta-built model: the
             engine's partition, its pre-flight estimate (`engine.memory_estimate`) and, where the
             spec sets `memory_limit`, its refusal (recorded, then the job fails).
    torch    torch.distributed.pipelining's meta-device recipe, as torchtitan's pipeline split
             does it: the layers of other stages deleted (`model.model.layers` becomes a ModuleDict
             keyed by the layer's index, so the state-dict keys stay the file's), the embedding,
             final norm and LM head set to None off their stage, `to_empty(device="cpu")`, this
             stage's tensors read with `safe_open`, the rotary `inv_freq` recomputed by the rotary
             module's own constructor; then `PipelineStage` and `Schedule1F1B`. The stage holds
             the layers the spec gives (Varuna's partition at the same P).

The attention runs through SDPA with no mask (causal by `is_causal`), in both systems: the torch
stage calls the decoder layers directly, and the first loss of each agrees with the other's.
"""

from __future__ import annotations

import ctypes
import gc
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LAYER = re.compile(r"^model\.layers\.(\d+)\.")
"""A decoder layer's parameter: its index is the first number."""


def status(field: str) -> int:
    """A figure of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def reset_peak() -> int:
    """Return freed memory to the system, reset VmHWM to the current VmRSS, and return VmRSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return status("VmRSS")


def llama_config(spec: dict[str, Any]) -> Any:
    """The spec's `transformers.LlamaConfig`, attention through SDPA."""
    import transformers

    config = transformers.LlamaConfig(**spec["config"])
    config._attn_implementation = "sdpa"
    return config


def meta_llama(spec: dict[str, Any]) -> Any:
    import transformers

    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config(spec))


def make_batch(spec: dict[str, Any]) -> dict[str, Tensor]:
    """The same global batch on every rank and in every system."""
    g = torch.Generator().manual_seed(1)
    vocab = spec["config"]["vocab_size"]
    ids = torch.randint(3, vocab, (spec["global_batch_size"], spec["seq_len"]), generator=g)
    return {"input_ids": ids, "labels": ids}


def layers_of(names: list[str]) -> list[int]:
    return sorted({int(m.group(1)) for n in names if (m := LAYER.match(n))})


def param_bytes(params: list[nn.Parameter]) -> int:
    unique = {id(p): p for p in params}
    return sum(p.numel() * p.element_size() for p in unique.values())


def run_varuna(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    from varuna import Varuna, auto_cut
    from varuna.errors import MemoryLimitError

    baseline = reset_peak()
    model = meta_llama(spec)
    auto_cut(model)
    batch = make_batch(spec)
    options: dict[str, Any] = {"optimizer_state": "none"}
    if spec["memory_limit"] is not None:
        options["memory_limit"] = spec["memory_limit"]
    if spec["weights"] is not None:
        options["weights"] = spec["weights"]
    record: dict[str, Any] = {"rank": rank, "baseline_bytes": baseline}
    try:
        engine = Varuna(
            model,
            pipeline=spec["pipeline"],
            data=1,
            global_batch_size=spec["global_batch_size"],
            micro_batch_size=spec["micro_batch_size"],
            schedule="1f1b",
            example_batch=batch,
            **options,
        )
    except MemoryLimitError as exc:
        record |= {"refused": str(exc), "peak_bytes": status("VmHWM")}
        write(spec, rank, record)
        raise
    built = status("VmHWM")
    params = list(engine.parameters())
    engine.set_optimizer(torch.optim.SGD(params, lr=spec["lr"]))
    losses = [engine.step(batch) for _ in range(spec["steps"])]
    peak = status("VmHWM")
    names = engine.partition.stage_params[engine.stage]
    record |= {
        "stage": engine.stage,
        "refused": None,
        "built_peak_bytes": built,
        "peak_bytes": peak,
        "rss_after_bytes": status("VmRSS"),
        "stage_param_bytes": param_bytes(params),
        "layers": layers_of(names),
        "embedding": "model.embed_tokens.weight" in names,
        "head": "lm_head.weight" in names,
        "losses": losses,
        "estimate": engine.memory_estimate.to_json(),
    }
    engine.close()
    return record


class TorchStage(nn.Module):
    """A pruned `LlamaForCausalLM` run as one torch.pipelining stage: ids (first stage) or hidden
    states in, hidden states or logits (last stage) out."""

    model: Any
    """The pruned `LlamaForCausalLM` (its state-dict keys are the file's)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        inner = self.model.model
        h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = inner.rotary_emb(h, position_ids)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rope)
        if inner.norm is not None:
            h = self.model.lm_head(inner.norm(h))
        return h


def causal_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """transformers' causal-LM loss: each position predicts the next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def load_from_folder(model: nn.Module, folder: Path) -> None:
    """Copy each state-dict tensor of `model` from the sharded folder, one shard open at a time."""
    from safetensors import safe_open

    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, list[tuple[str, Tensor]]] = {}
    for key, dest in model.state_dict(keep_vars=True).items():
        by_file.setdefault(weight_map[key], []).append((key, dest))
    with torch.no_grad():
        for file, wanted in by_file.items():
            with safe_open(str(folder / file), framework="pt", device="cpu") as f:
                for key, dest in wanted:
                    dest.copy_(f.get_tensor(key))


def torch_stage_model(spec: dict[str, Any], rank: int) -> Any:
    """The meta model cut to this rank's stage and made real, as torchtitan's split does it."""
    P = spec["pipeline"]
    model = meta_llama(spec)
    inner = model.model
    keep = set(spec["stage_layers"][rank])
    inner.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(inner.layers) if i in keep})
    if rank != 0:
        inner.embed_tokens = None
    if rank != P - 1:
        inner.norm = None
        model.lm_head = None
    model.to_empty(device="cpu")
    load_from_folder(model, Path(spec["weights"]))
    fresh = type(inner.rotary_emb)(model.config)  # the non-persistent buffers, computed for real
    with torch.no_grad():
        for name, buffer in fresh.named_buffers():
            inner.rotary_emb.get_buffer(name).copy_(buffer)
    return model


def run_torch(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    P = spec["pipeline"]
    M = spec["global_batch_size"] // spec["micro_batch_size"]
    baseline = reset_peak()
    model = torch_stage_model(spec, rank)
    built = status("VmHWM")
    module = TorchStage(model)
    stage = PipelineStage(module, rank, P, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=M, loss_fn=causal_lm_loss)
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=spec["lr"])
    batch = make_batch(spec)
    losses: list[float] = []
    for _ in range(spec["steps"]):
        opt.zero_grad(set_to_none=True)
        args = (batch["input_ids"],) if rank == 0 else ()
        if rank == P - 1:
            mb_losses: list[Tensor] = []
            schedule.step(*args, target=batch["labels"], losses=mb_losses)
            losses.append(float(torch.stack(mb_losses).detach().mean()))
        else:
            schedule.step(*args)
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    return {
        "rank": rank,
        "stage": rank,
        "baseline_bytes": baseline,
        "built_peak_bytes": built,
        "peak_bytes": status("VmHWM"),
        "rss_after_bytes": status("VmRSS"),
        "stage_param_bytes": param_bytes(params),
        "layers": layers_of(names),
        "embedding": rank == 0,
        "head": rank == P - 1,
        "losses": losses,
    }


def write(spec: dict[str, Any], rank: int, record: dict[str, Any]) -> None:
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(record))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    # everything either system imports, imported before the baseline (transformers loads its
    # model code lazily, on first use)
    from torch.distributed import pipelining  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401

    import varuna.engine.engine  # noqa: F401
    from varuna.comm.rendezvous import init_distributed

    rank, _ = init_distributed()
    record = run_varuna(spec, rank) if spec["system"] == "varuna" else run_torch(spec, rank)
    write(spec, rank, record)


if __name__ == "__main__":
    main()
