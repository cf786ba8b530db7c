"""`varuna.consolidate`: one safetensors state dict of the plain model from a checkpoint saved at any P x D.

A checkpoint is spread over the ranks' files and keyed by canonical parameter name, one entry per
tied weight ("model.<name>", "buffer.<key>"); the plain model's `state_dict()` has one entry per name
a tensor is registered under. The engine records at save time where each key comes from (the
"state_dict" layout in `extra.json`, see `varuna.engine.train_state.state_dict_layout`), so this reads the
checkpoint in one process, without torch.distributed, and writes exactly the keys the plain model
loads with `strict=True`:

    checkpoint                                       out.safetensors
    model.transformer.wte.weight  --------------+--> transformer.wte.weight
                                                +--> lm_head.weight            (a copy: safetensors
    model.transformer.h.0.attn.c_attn.weight  -----> transformer.h.0.attn...    refuses shared storage)
    buffer.bn.running_mean  -----------------------> bn.running_mean

    varuna.consolidate("runs/gpt", "gpt.safetensors")          # the run's latest checkpoint
    model.load_state_dict(safetensors.torch.load_file("gpt.safetensors"))
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from varuna.checkpoint import layout as ckpt
from varuna.errors import CheckpointError

__all__ = ["consolidate"]

_WHERE = "give a step directory (RUN/checkpoints/step-XXXXXXXX), a checkpoints/ directory or a run directory"
_PREFIX = {"param": "model.", "buffer": "buffer."}


def consolidate(
    checkpoint: str | os.PathLike[str], out: str | os.PathLike[str], *, model: nn.Module | None = None
) -> Path:
    """Write the plain model's state dict from `checkpoint` to the safetensors file `out`; returns `out`.

    `checkpoint` is a step directory, or a `checkpoints/` directory or run directory (its latest
    checkpoint). With `model`, the checkpoint's keys and shapes are checked against
    `model.state_dict()` first. The file's metadata holds {"format": "pt", "varuna_step": step}.

        varuna.consolidate("runs/gpt", "out/gpt.safetensors", model=GPT(cfg))
    """
    path = find_checkpoint(Path(checkpoint))
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(
            f"{out} is a directory; give the file to write, e.g. {out / 'model.safetensors'}"
        )
    ckpt.verify(path)
    extra = ckpt.read_extra(path)
    layout: dict[str, list[str]] | None = extra.get("state_dict")
    if layout is None:
        raise CheckpointError(
            f"checkpoint {path} was saved by a Varuna that did not record the model's state_dict layout "
            "(nor its buffers); resume from it with this Varuna and call engine.checkpoint() once, "
            "then consolidate the new checkpoint"
        )
    stored = ckpt.stored_tensors(path)
    sources = _sources(layout, stored, path)
    if model is not None:
        check_fits(model, {k: stored[s][0] for k, s in sources.items()}, extra, path)
    tensors = {s: torch.empty(stored[s][0], dtype=stored[s][1]) for s in set(sources.values())}
    ckpt.load_tensors(path, tensors)
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key, source in sources.items():
        state[key] = tensors[source].clone() if source in used else tensors[source]
        used.add(source)
    _save_atomic(state, out, {"format": "pt", "varuna_step": str(int(extra["step"]))})
    return out


def find_checkpoint(path: Path) -> Path:
    """The step directory `path` names: itself, or the latest under it (or under its checkpoints/)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist; {_WHERE}")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a file, not a checkpoint directory; {_WHERE}")
    if any((path / f).exists() for f in ("manifest.json", "extra.json", "metadata.json", ".metadata")):
        return path  # a step directory (an uncommitted or old one fails verify, which says so)
    for root in (path, path / "checkpoints"):
        found = ckpt.latest(root)  # `latest` confined to root, or the newest complete one
        if found is not None:
            return found
    raise CheckpointError(
        f"{path} holds no checkpoint (no manifest.json, latest or checkpoints/latest); {_WHERE}"
    )


def _sources(
    layout: dict[str, list[str]], stored: dict[str, tuple[tuple[int, ...], torch.dtype]], path: Path
) -> dict[str, str]:
    """State dict key -> the stored tensor it is read from; warns of keys that are not tensors."""
    sources: dict[str, str] = {}
    others: list[str] = []
    for key, (kind, name) in layout.items():
        if kind not in _PREFIX:
            others.append(key)
            continue
        sources[key] = _PREFIX[kind] + name
    absent = sorted(k for k, s in sources.items() if s not in stored)
    if absent:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {len(absent)} state_dict entries have no stored tensor "
            f"({', '.join(f'{k} <- {sources[k]}' for k in absent[:5])}); consolidate another checkpoint"
        )
    if others:
        warnings.warn(
            f"{len(others)} state_dict entries are neither parameters nor buffers (e.g. {others[:3]}) and are "
            "not in the checkpoint; load the consolidated file with load_state_dict(..., strict=False)",
            stacklevel=3,
        )
    return sources


def check_fits(
    model: nn.Module, shapes: dict[str, tuple[int, ...]], extra: dict[str, Any], path: Path
) -> None:
    """The checkpoint's state dict has exactly `model`'s keys and shapes; else say what differs."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(want) - set(shapes))
    unexpected = sorted(set(shapes) - set(want))
    wrong = sorted(k for k in set(want) & set(shapes) if want[k] != tuple(shapes[k]))
    if not (missing or unexpected or wrong):
        return
    saved = extra.get("model") or {}
    lines = [
        f"checkpoint {path} does not fit this {type(model).__name__}: it was saved from a "
        f"{saved.get('class', 'model')} with {saved.get('parameters', '?')} parameters "
        f"({len(shapes)} state_dict entries; this model has {len(want)}). Pass that model, or no model=:"
    ]
    for what, keys, show in (
        ("missing from the checkpoint", missing, lambda k: f"{k} {want[k]}"),
        ("not in this model", unexpected, lambda k: f"{k} {tuple(shapes[k])}"),
        ("shape differs", wrong, lambda k: f"{k} model {want[k]} vs checkpoint {tuple(shapes[k])}"),
    ):
        if keys:
            more = f" (and {len(keys) - 5} more)" if len(keys) > 5 else ""
            lines.append(f"  {len(keys)} {what}: {', '.join(show(k) for k in keys[:5])}{more}")
    raise CheckpointError("\n".join(lines))


def _save_atomic(state: dict[str, torch.Tensor], out: Path, metadata: dict[str, str]) -> None:
    """Write to a temporary name beside `out`, then rename: a reader never sees half a file."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        save_file(state, str(tmp), metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
