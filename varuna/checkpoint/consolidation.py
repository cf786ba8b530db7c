"""`varuna.consolidate`: the plain model's state dict, as Hugging Face safetensors, from a checkpoint saved at any P x D.

A checkpoint is spread over the ranks' files and keyed by canonical parameter name, one entry per
tied weight ("model.<name>", "buffer.<key>"); the plain model's `state_dict()` has one entry per name
a tensor is registered under. The engine records at save time where each key comes from (the
"state_dict" layout in `extra.json`, see `varuna.engine.train_state.state_dict_layout`), so this reads the
checkpoint in one process, without torch.distributed, and writes exactly the keys the plain model
loads with `strict=True`:

    checkpoint                                       state dict
    model.transformer.wte.weight  --------------+--> transformer.wte.weight
                                                +--> lm_head.weight            (a copy: safetensors
    model.transformer.h.0.attn.c_attn.weight  -----> transformer.h.0.attn...    refuses shared storage)
    buffer.bn.running_mean  -----------------------> bn.running_mean

`out` is a folder in Hugging Face's sharded layout (what `save_pretrained` writes), or one file:

    out/                                      (a folder: streamed, about one shard in memory at a time)
      model-00001-of-00003.safetensors        keys in the state dict's order, each shard at most
      model-00002-of-00003.safetensors        max_shard_size bytes (a tensor larger than that, or a
      model-00003-of-00003.safetensors        tied weight's copies together, get a shard of their own)
      model.safetensors.index.json            {"metadata": {"total_size": bytes, "varuna_step": "3"},
                                               "weight_map": {key: shard file}}, written last
      config.json                             with config= or a transformers model=
    out/model.safetensors                     (all in one shard: no index, as save_pretrained does)
    gpt.safetensors                           (a name ending in .safetensors: one file, the whole
                                               model in memory when it is written; for small models)

Each shard's tensors are read from the checkpoint by name (only those), written to a hidden
temporary name, fsynced and renamed, and freed before the next shard is read; both copies of a
tied weight go into the same shard, so the copy lives only as long as that shard. The old index
is removed before the first shard and the new one written after the last, so a failure never
leaves an index describing shards it did not write; shards of an earlier run with another count
are removed at the end.

    varuna.consolidate("runs/gpt2", "out/gpt2", model=GPT2LMHeadModel(cfg))   # the run's latest checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained("out/gpt2")
    varuna.consolidate("runs/gpt", "gpt.safetensors")                        # one file, a small model
    model.load_state_dict(safetensors.torch.load_file("gpt.safetensors"))
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from varuna._files import write_atomic
from varuna.checkpoint import layout as ckpt
from varuna.errors import CheckpointError, ConfigError, PlanError

__all__ = ["consolidate", "find_checkpoint", "plan_shards", "shard_limit", "written_files"]

log = logging.getLogger("varuna.consolidate")

_WHERE = "give a step directory (RUN/checkpoints/step-XXXXXXXX), a checkpoints/ directory or a run directory"
_PREFIX = {"param": "model.", "buffer": "buffer."}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TEMPORARY = re.compile(
    r"\.(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json)(\.\d+)?\.tmp"
)
_SIZES = "e.g. 5GB, 200MB or 10MiB (GB is 10**9 bytes, as in Hugging Face; GiB is 2**30)"

Stored = dict[str, tuple[tuple[int, ...], torch.dtype]]


def consolidate(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    model: nn.Module | None = None,
    config: Any = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write the plain model's state dict from `checkpoint` to `out` (see the module docstring); returns `out`.

    `checkpoint` is a step directory, or a `checkpoints/` directory or run directory (its latest
    checkpoint). `out` ending in `.safetensors` is one file; anything else is a folder in Hugging
    Face's sharded layout, read and written one shard of at most `max_shard_size` (bytes, or a size
    such as "5GB", "200MB", "10MiB") at a time. With `model`, the checkpoint's keys and shapes are
    checked against `model.state_dict()` first. `config` (a transformers `PretrainedConfig`, or any
    object with `to_json_file(path)` or `save_pretrained(folder)`), or else the `.config` of a
    transformers `model`, is written to the folder as `config.json`, so `from_pretrained(out)`
    loads it. Every file's metadata holds {"format": "pt", "varuna_step": step}.

        varuna.consolidate("runs/gpt2", "out/gpt2", model=transformers.GPT2LMHeadModel(cfg))
        varuna.consolidate("runs/gpt", "out/gpt.safetensors", model=GPT(cfg))
    """
    limit = shard_limit(max_shard_size)
    path = find_checkpoint(Path(checkpoint))
    out = Path(out)
    single = out.suffix == ".safetensors"
    _check_out(out, single, config)
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
    shards = plan_shards(sources, stored, limit)
    metadata = {"format": "pt", "varuna_step": str(int(extra["step"]))}
    if single:
        state: dict[str, torch.Tensor] = {}
        for keys in shards:  # read a shard's worth at a time; the file needs them all at once
            state |= _read(path, keys, sources, stored)
        _save_atomic(state, out, metadata)
        log.info("wrote %s (%d tensors) from %s", out, len(state), path)
        return out
    if config is None and model is not None:
        config = _transformers_config(model)
    _write_folder(path, out, shards, sources, stored, metadata, config)
    return out


def _check_out(out: Path, single: bool, config: Any) -> None:
    """`out` can be written as asked: a file name that is not a folder, a folder that is not a file."""
    if single and out.is_dir():
        raise CheckpointError(
            f"{out} is a directory, and a name ending in .safetensors is the one file to write; give "
            f"another file name (e.g. {out / SINGLE}), or a folder name without the suffix for the sharded layout"
        )
    if not single and out.exists() and not out.is_dir():
        raise CheckpointError(
            f"{out} is a file; give a folder for Hugging Face's sharded layout "
            "(model-00001-of-0000N.safetensors and model.safetensors.index.json), or a name ending in "
            ".safetensors for one file"
        )
    if config is not None and not (hasattr(config, "to_json_file") or hasattr(config, "save_pretrained")):
        raise ConfigError(
            f"config= takes a transformers PretrainedConfig (an object with to_json_file or save_pretrained), "
            f"got a {type(config).__name__}"
        )
    if config is not None and single:
        raise ConfigError(
            f"config= writes config.json beside the weights; give a folder as out (not {out}) for the "
            "Hugging Face layout, or no config="
        )


def shard_limit(max_shard_size: int | str) -> int:
    """Bytes in `max_shard_size`: a positive int of bytes, or a size such as "5GB", "200MB", "10MiB"."""
    from varuna.planner import parse_memory

    if not isinstance(max_shard_size, (int, str)) or isinstance(max_shard_size, bool):
        raise ConfigError(
            f"max_shard_size (--max-shard-size) takes a number of bytes or a size, {_SIZES}; "
            f"got a {type(max_shard_size).__name__}"
        )
    try:
        return parse_memory(max_shard_size)
    except PlanError:
        raise ConfigError(
            f"max_shard_size (--max-shard-size) must be a positive number of bytes or a size, {_SIZES}; "
            f"got {max_shard_size!r}"
        ) from None


def plan_shards(sources: dict[str, str], stored: Stored, limit: int) -> list[list[str]]:
    """The state dict's keys cut into shards of at most `limit` bytes, in order, as save_pretrained does.

    The keys read from one stored tensor (a tied weight's names) stay together; a group larger
    than `limit` gets a shard of its own. An empty state dict is one empty shard.
    """
    groups: dict[str, list[str]] = {}
    for key, source in sources.items():
        groups.setdefault(source, []).append(key)
    shards: list[list[str]] = []
    current: list[str] = []
    size = 0
    for source, keys in groups.items():
        n = _nbytes(stored[source]) * len(keys)
        if n > limit:
            shards.append(keys)
            continue
        if current and size + n > limit:
            shards.append(current)
            current, size = [], 0
        current += keys
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def written_files(out: Path) -> list[Path]:
    """The safetensors files a consolidation wrote at `out`: the file itself, or the folder's shards."""
    if not out.is_dir():
        return [out]
    index = out / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [out / name for name in sorted(set(weight_map.values()))]
    return [out / SINGLE]


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


def _write_folder(
    path: Path,
    out: Path,
    shards: list[list[str]],
    sources: dict[str, str],
    stored: Stored,
    metadata: dict[str, str],
    config: Any,
) -> None:
    """Hugging Face's sharded layout in `out`, one shard in memory at a time; the index last."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if _TEMPORARY.fullmatch(old.name):  # of a run killed while writing: unreadable, possibly large
            old.unlink()
    if config is not None:
        _write_config(config, out)
    (out / INDEX).unlink(missing_ok=True)  # no index may describe a folder half rewritten
    count = len(shards)
    names = (
        [SINGLE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    with tqdm(
        total=count, unit="shard", desc=f"consolidating {path.name}", disable=not sys.stderr.isatty()
    ) as bar:
        for name, keys in zip(names, shards):
            state = _read(path, keys, sources, stored)
            nbytes = sum(t.nbytes for t in state.values())
            _save_atomic(state, out / name, metadata)
            del state
            weight_map |= dict.fromkeys(keys, name)
            total += nbytes
            bar.update()
            log.info("wrote %s (%d tensors, %d bytes)", out / name, len(keys), nbytes)
    if count > 1:
        index = {
            "metadata": {"total_size": total, "varuna_step": metadata["varuna_step"]},
            "weight_map": weight_map,
        }
        write_atomic(out / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode(), fsync=True)
    for old in out.iterdir():
        if (old.name == SINGLE or _SHARD.fullmatch(old.name)) and old.name not in names:
            old.unlink()
    _fsync_dir(out)
    log.info("wrote %s: %d shards, %d tensors, %d bytes, from %s", out, count, len(weight_map), total, path)


def _read(path: Path, keys: list[str], sources: dict[str, str], stored: Stored) -> dict[str, torch.Tensor]:
    """The state dict entries `keys`, read from the checkpoint (only their stored tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        if sources[key] not in tensors:
            shape, dtype = stored[sources[key]]
            tensors[sources[key]] = torch.empty(shape, dtype=dtype)
    ckpt.load_tensors(path, tensors)
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key in keys:
        source = sources[key]
        state[key] = tensors[source].clone() if source in used else tensors[source]
        used.add(source)
    return state


def _nbytes(spec: tuple[tuple[int, ...], torch.dtype]) -> int:
    shape, dtype = spec
    return torch.Size(shape).numel() * dtype.itemsize


def _transformers_config(model: nn.Module) -> Any:
    """The config of a transformers model (a PretrainedConfig: it has `to_json_file`), else None."""
    config = getattr(model, "config", None)
    return config if hasattr(config, "to_json_file") else None


def _write_config(config: Any, out: Path) -> None:
    """`config.json` in `out`, through a temporary name where the config can write to any path."""
    if not hasattr(config, "to_json_file"):
        config.save_pretrained(out)
        return
    final = out / "config.json"
    tmp = out / f".config.json.{os.getpid()}.tmp"
    try:
        config.to_json_file(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    """Make the renames in `folder` durable (where the platform can open a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
