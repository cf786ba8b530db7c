"""Pretrained weights for one pipeline stage, read lazily from safetensors.

Every rank knows the whole model's state-dict keys and shapes (from a copy built on the meta device)
but holds real tensors only for its own stage. Loading is therefore three steps: read the headers,
check the whole file set against the whole model (on every rank, so every rank fails the same way
before training), then read only this stage's tensors:

    source = WeightsSource.open("gpt2/")                  # headers only: key -> (file, dtype, shape)
    mapping = match_keys(source, model_shapes, aliases)   # model key -> file key, for every model key
    load_stage(source, mapping, stage_tensors)            # each shard opened once, wanted keys only

    gpt2/model.safetensors.index.json      {"weight_map": {"transformer.wte.weight": "model-00001-of-00002...", ...}}
    gpt2/model-00001-of-00002.safetensors  [ transformer.wte.weight | transformer.wpe.weight | h.0 ... ]
    gpt2/model-00002-of-00002.safetensors  [ ... h.1 ... | transformer.ln_f.weight | ... ]
                                                 ^                         ^
    the last stage wants h.1.*, ln_f.* and lm_head.weight (tied to transformer.wte.weight): both shards

A source is a `.safetensors` file, a folder with `model.safetensors.index.json` and the shards it
names (Hugging Face's sharded `save_pretrained`), or a folder with one `model.safetensors` (its
un-sharded output; read first when a folder holds both, as transformers does).

Tied weights: `aliases` maps a canonical name to every name of one tensor (e.g.
`{"transformer.wte.weight": ["transformer.wte.weight", "lm_head.weight"]}`). `save_pretrained` writes
a tied tensor once, so the group is satisfied by any of its names in the file; the first found
(canonical first, then in the order given) is read for all of them.

Prefixes: the file may hold the keys of a submodule the model wraps (file `transformer.wte.weight`,
model `model.transformer.wte.weight`), or its keys may carry a prefix the model's lack (file
`model.x`, model `x`). `match_keys` finds the one prefix by this rule, and never guesses among several:

1. No prefix, when every file key is a model key.
2. Otherwise the candidates come from the first file key `k` (in sorted order): each `P` ending in
   "." such that `P + k` is a model key (add `P` to the file's keys), and each `P` ending in "." such
   that `k == P + m` for a model key `m` (strip `P` from them). A candidate is chosen when it maps
   every file key onto a model key; exactly one may do so, several are an error.
3. Otherwise, when some file keys are model keys as they are, no prefix: the others are reported as
   not in the model.
4. Otherwise an error shows a few file keys and model keys, and how far each candidate got.

Missing keys, unexpected keys and shape differences are reported together, in one CheckpointError.
Dtypes need not match: each tensor is cast to its destination's dtype (a bf16 file into fp32).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
from safetensors import SafetensorError, safe_open

from varuna.errors import CheckpointError

__all__ = ["WeightsSource", "match_keys", "load_stage"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_EXPECTED = (
    f"give a .safetensors file, a folder with {INDEX} and its shards, or a folder with {SINGLE} "
    "(as save_pretrained writes them)"
)
_CONVERT = (
    "convert it once: save_pretrained(folder) writes safetensors, or "
    "safetensors.torch.save_file(state_dict, 'model.safetensors')"
)
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HEADER_LIMIT = 100 << 20
"""safetensors' own bound on a header's size: a larger length field means a damaged file."""
_SHOW = 5

_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}


@dataclass(frozen=True, slots=True)
class _Entry:
    """Where one tensor lies: its file, dtype, shape, and its offset in the file's data (to read in order)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


class WeightsSource:
    """The tensors of a safetensors file or sharded folder: key -> (file, dtype, shape), read from headers only.

    source = WeightsSource.open("gpt2/")
    source.keys                              # ('transformer.h.0.attn.c_attn.bias', ...), sorted
    source.shape("transformer.wte.weight")   # (50257, 768)
    source.file("transformer.wte.weight")    # gpt2/model-00001-of-00002.safetensors
    """

    def __init__(self, path: Path, entries: Mapping[str, _Entry]) -> None:
        self.path = path
        self._entries = dict(sorted(entries.items()))

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> WeightsSource:
        """Read the headers of the file at `path`, or of the shards its folder's index names."""
        path = Path(path)
        if path.is_dir():
            if (path / SINGLE).is_file():
                return cls(path, _read_header(path / SINGLE))
            if (path / INDEX).is_file():
                return cls(path, _read_index(path / INDEX))
            raise CheckpointError(
                f"folder {path} holds neither {INDEX} nor {SINGLE} ({_folder(path)}); {_EXPECTED}"
            )
        if path.is_file():
            if path.name.endswith(".safetensors"):
                return cls(path, _read_header(path))
            if path.name.endswith(".safetensors.index.json"):
                return cls(path, _read_index(path))
            if path.suffix in _PICKLES:
                raise CheckpointError(
                    f"{path} is a torch pickle ({path.suffix}), which is not read here; {_EXPECTED}; {_CONVERT}"
                )
            raise CheckpointError(f"{path} is not a .safetensors file; {_EXPECTED}")
        raise CheckpointError(f"{path} does not exist; {_EXPECTED}")

    @property
    def keys(self) -> tuple[str, ...]:
        """Every tensor's key, sorted."""
        return tuple(self._entries)

    @property
    def files(self) -> tuple[Path, ...]:
        """The files the tensors lie in, sorted."""
        return tuple(sorted({e.file for e in self._entries.values()}))

    def shape(self, key: str) -> tuple[int, ...]:
        """The shape of tensor `key`."""
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        """The dtype tensor `key` is stored in."""
        return self._entry(key).dtype

    def file(self, key: str) -> Path:
        """The file tensor `key` lies in."""
        return self._entry(key).file

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"WeightsSource({str(self.path)!r}, {len(self)} tensors in {len(self.files)} files)"

    def _entry(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise CheckpointError(
                f"weights at {self.path} hold no tensor {key!r} ({len(self)} tensors, e.g. "
                f"{_few(self._entries)}); ask for one of source.keys"
            )
        return entry


def match_keys(
    source: WeightsSource,
    model_shapes: Mapping[str, Sequence[int]],
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, str]:
    """Model key -> file key for every model key; raises CheckpointError listing missing, unexpected and
    mis-shaped keys.

    `model_shapes` is the whole model's state dict (every name of every parameter, and the persistent
    buffers); `aliases` maps a canonical name to all names of one tied tensor. The file's keys may be
    the model's under one prefix, found by the rule in this module's docstring.

        mapping = match_keys(source, {k: tuple(v.shape) for k, v in meta_model.state_dict().items()},
                             {"transformer.wte.weight": ["transformer.wte.weight", "lm_head.weight"]})
        mapping["lm_head.weight"]   # 'transformer.wte.weight': the file holds the tied tensor once
    """
    shapes = {k: tuple(int(d) for d in s) for k, s in model_shapes.items()}
    groups = _tie_groups(shapes, aliases or {})
    prefix = _find_prefix(source.keys, shapes)
    by_model: dict[str, str] = {}
    unexpected: list[str] = []
    for key in source.keys:
        name = prefix.model_key(key)
        if name in shapes:
            by_model[name] = key
        else:
            unexpected.append(key)
    mapping: dict[str, str] = {}
    missing: list[tuple[str, ...]] = []
    for group in groups:
        found = [by_model[name] for name in group if name in by_model]
        if found:
            mapping.update((name, found[0]) for name in group)
        else:
            missing.append(group)
    wrong = sorted(name for name, key in by_model.items() if source.shape(key) != shapes[name])
    if missing or unexpected or wrong:
        raise CheckpointError(_report(source, shapes, prefix, by_model, missing, unexpected, wrong))
    return mapping


def load_stage(
    source: WeightsSource, mapping: Mapping[str, str], tensors: Mapping[str, torch.Tensor]
) -> None:
    """Copy each wanted tensor (model key -> real destination tensor) from the files.

    Each file holding a wanted key is opened once with `safetensors.safe_open` and only the wanted
    keys are read, in their order in the file, one at a time: each is cast to its destination's
    dtype and copied into it on its device. A file key wanted under several model keys (tied names
    on one stage) is read once. `mapping` comes from `match_keys`.

        load_stage(source, mapping, {k: v for k, v in stage.state_dict(keep_vars=True).items()})
    """
    wanted: dict[Path, dict[str, list[torch.Tensor]]] = {}
    for name, dest in tensors.items():
        key = mapping.get(name)
        if key is None:
            raise CheckpointError(
                f"{name} has no entry in the mapping ({len(mapping)} keys, e.g. {_few(mapping)}); "
                "build it with match_keys over the whole model's state_dict, this stage's keys included"
            )
        if tuple(dest.shape) != source.shape(key):
            raise CheckpointError(
                f"{name}: destination shape {tuple(dest.shape)} vs file {key} {source.shape(key)}; "
                "allocate each destination with its model shape, the one match_keys checked"
            )
        if dest.is_meta:
            raise CheckpointError(
                f"{name} is on the meta device and cannot hold values; allocate the stage first "
                "(module.to_empty(device=...)) and pass its real tensors"
            )
        wanted.setdefault(source.file(key), {}).setdefault(key, []).append(dest)
    with torch.no_grad():
        for file, keys in wanted.items():
            _read_into(file, sorted(keys.items(), key=lambda kv: source._entries[kv[0]].offset))


def _read_into(file: Path, keys: Iterable[tuple[str, list[torch.Tensor]]]) -> None:
    """Read each key of `file` once and copy it into its destinations."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key, dests in keys:
                tensor = f.get_tensor(key)
                for dest in dests:
                    dest.copy_(tensor)
                del tensor
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"cannot read {file}: {e}; the file is damaged or changed since its header was read: "
            "copy or download it again"
        ) from e


def _read_header(file: Path) -> dict[str, _Entry]:
    """The tensors a safetensors file holds, from its header (an 8-byte length, then JSON)."""
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little")
        if size < 8 or length > min(size - 8, _HEADER_LIMIT):
            _not_safetensors(file, f"its header length field ({length}) does not fit its {size} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        _not_safetensors(file, f"its header is not JSON ({e})")
    if not isinstance(header, dict):
        _not_safetensors(file, "its header is not a JSON object")
    entries: dict[str, _Entry] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype_name, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            entry_shape = tuple(int(d) for d in shape)
            offset = int(offsets[0])
        except (TypeError, KeyError, ValueError, IndexError) as e:
            _not_safetensors(file, f"its entry {key!r} lacks a dtype, shape or data_offsets ({e!r})")
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(
                f"{file}: tensor {key} is stored as {dtype_name}, which is not read here "
                f"(expected one of {', '.join(_DTYPES)}); save it in one of those dtypes"
            )
        entries[key] = _Entry(file, dtype, entry_shape, offset)
    return entries


def _not_safetensors(file: Path, why: str) -> NoReturn:
    raise CheckpointError(
        f"{file} is not a safetensors file: {why}; give a file written by safetensors "
        "(save_file or save_pretrained), or copy or download it again"
    )


def _read_index(index: Path) -> dict[str, _Entry]:
    """The tensors of a sharded folder: the index's weight_map, checked against each shard's header."""
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read index {index}: {e}; save the checkpoint again") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"index {index} has no weight_map of tensor key -> shard file name "
            '(expected {"weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors", ...}}); '
            "save the checkpoint again with save_pretrained"
        )
    shards: dict[str, set[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, set()).add(key)
    absent = sorted(s for s in shards if not (index.parent / s).is_file())
    if absent:
        raise CheckpointError(
            f"index {index} names {len(absent)} shard file(s) that do not exist in {index.parent}: "
            f"{', '.join(absent)} (of {len(shards)} shards); copy or download the missing shards"
        )
    entries: dict[str, _Entry] = {}
    problems: list[str] = []
    for shard, listed in sorted(shards.items()):
        held = _read_header(index.parent / shard)
        lacking = sorted(listed - held.keys())
        extra = sorted(held.keys() - listed)
        if lacking:
            problems.append(
                f"the index places {len(lacking)} keys in {shard}, which lacks them: {_few(lacking)}"
            )
        if extra:
            problems.append(f"{shard} holds {len(extra)} keys the index does not place there: {_few(extra)}")
        entries.update((k, held[k]) for k in listed & held.keys())
    if problems:
        raise CheckpointError(
            f"index {index} does not match its shards ({'; '.join(problems)}); the index and the shards "
            "come from different saves: save the checkpoint again, or copy the whole folder anew"
        )
    return entries


def _folder(path: Path) -> str:
    """What a folder holds, in a few names, with a hint when the weights are there under other names."""
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return "it is empty"
    said = f"it holds {_few(names)}"
    tensors = [n for n in names if n.endswith(".safetensors")]
    if tensors:
        return f"{said}; to read one file, give its path, e.g. {path / tensors[0]}"
    if any(n.endswith(_PICKLES) for n in names):
        return f"{said}; its weights are torch pickles, {_CONVERT}"
    return said


@dataclass(frozen=True, slots=True)
class _Prefix:
    """How a file key becomes a model key: strip `strip` from its front, then put `add` there."""

    add: str = ""
    strip: str = ""

    def model_key(self, key: str) -> str | None:
        if not key.startswith(self.strip):
            return None
        return self.add + key[len(self.strip) :]

    def __str__(self) -> str:
        if self.add:
            return f"prefix {self.add!r} added to the file's keys"
        if self.strip:
            return f"prefix {self.strip!r} stripped from the file's keys"
        return "no prefix"


def _find_prefix(file_keys: Sequence[str], shapes: Mapping[str, object]) -> _Prefix:
    """The one prefix that turns the file's keys into model keys, by the rule in the module docstring."""
    none = _Prefix()
    if all(k in shapes for k in file_keys):
        return none
    first = file_keys[0]
    candidates = [_Prefix(add=m[: -len(first)]) for m in shapes if m.endswith("." + first)]
    candidates += [
        _Prefix(strip=first[: i + 1]) for i, c in enumerate(first) if c == "." and first[i + 1 :] in shapes
    ]
    full = [p for p in candidates if all(p.model_key(k) in shapes for k in file_keys)]
    if len(full) == 1:
        return full[0]
    keys = f"file keys ({len(file_keys)}): {_few(file_keys)}; model keys ({len(shapes)}): {_few(shapes)}"
    fix = (
        "load the weights into the submodule whose state_dict keys the file holds, "
        "or rename the file's keys to the model's state_dict keys"
    )
    if full:
        raise CheckpointError(
            f"cannot tell which prefix turns the weights' keys into the model's: {len(full)} do "
            f"({'; '.join(str(p) for p in full)}), and none is preferred; {keys}; {fix}"
        )
    if any(k in shapes for k in file_keys):
        return none
    tried = []
    for p in candidates[:3]:
        unmatched = [k for k in file_keys if p.model_key(k) not in shapes]
        tried.append(f"with {p}, {len(file_keys) - len(unmatched)} match (not: {_few(unmatched, 3)})")
    attempts = "; ".join(tried) if tried else f"no prefix makes the first file key {first!r} a model key"
    raise CheckpointError(
        f"the weights' keys are not the model's under any one prefix: no file key is a model key as it is "
        f"({attempts}); {keys}; {fix}"
    )


def _tie_groups(
    shapes: Mapping[str, tuple[int, ...]], aliases: Mapping[str, Sequence[str]]
) -> list[tuple[str, ...]]:
    """Every model key once, in a group with the other names of its tensor (canonical name first)."""
    group_of: dict[str, tuple[str, ...]] = {}
    for canonical, names in aliases.items():
        group = tuple(dict.fromkeys([canonical, *names]))
        unknown = [n for n in group if n not in shapes]
        if unknown:
            raise CheckpointError(
                f"aliases of {canonical} name {_few(unknown)}, which model_shapes lacks; "
                "give aliases of the model's state_dict keys (every name of a tied parameter)"
            )
        taken = [n for n in group if n in group_of]
        if taken:
            raise CheckpointError(
                f"aliases put {taken[0]} in two groups ({', '.join(group_of[taken[0]])} and "
                f"{', '.join(group)}); give each tied tensor's names in one group"
            )
        sizes = sorted({shapes[n] for n in group})
        if len(sizes) > 1:
            raise CheckpointError(
                f"aliases {', '.join(group)} name one tensor but model_shapes gives them shapes "
                f"{', '.join(map(str, sizes))}; group only names of the same tensor"
            )
        group_of.update((n, group) for n in group)
    groups: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for key in shapes:
        if key not in seen:
            group = group_of.get(key, (key,))
            groups.append(group)
            seen.update(group)
    return groups


def _report(
    source: WeightsSource,
    shapes: Mapping[str, tuple[int, ...]],
    prefix: _Prefix,
    by_model: Mapping[str, str],
    missing: Sequence[tuple[str, ...]],
    unexpected: Sequence[str],
    wrong: Sequence[str],
) -> str:
    """One message for every difference between the weights and the model, with what to change."""

    def tied(group: tuple[str, ...]) -> str:
        also = f" (tied: {', '.join(group[1:])})" if len(group) > 1 else ""
        return f"{group[0]} {shapes[group[0]]}{also}"

    lines = [
        f"weights at {source.path} do not match the model ({prefix}; {len(source)} tensors in the "
        f"weights, {len(shapes)} state_dict keys in the model):"
    ]
    for what, items in (
        ("missing from the weights", [tied(g) for g in missing]),
        ("not in the model", [f"{k} {source.shape(k)}" for k in unexpected]),
        ("shape differs", [f"{m} model {shapes[m]} vs file {source.shape(by_model[m])}" for m in wrong]),
    ):
        if items:
            lines.append(f"  {what} ({len(items)}): {_few(items)}")
    fix = (
        "fix: give weights saved from this model's architecture and config, "
        "or build the model with the config the weights were saved from (layers, hidden and vocabulary sizes)"
    )
    if unexpected:
        fix += (
            "; if the keys are only named differently, rename the file's keys to the model's state_dict keys"
        )
    lines.append(fix)
    return "\n".join(lines)


def _few(items: Iterable[str], n: int = _SHOW) -> str:
    """The first `n` items, comma-separated, and how many more there are."""
    items = list(items)
    more = f" (and {len(items) - n} more)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
