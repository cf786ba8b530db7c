"""The checkpoint's metadata and extra values as JSON: nothing on the load path unpickles.

DCP's stock writer pickles its `Metadata` into `.metadata` and its reader unpickles it, so a forged
`.metadata` runs code when a checkpoint is loaded or inspected. Here the writer stores what loading
needs in `metadata.json` and the reader rebuilds DCP's `Metadata` from it, checking every field's
type; a file that is not this JSON is a CheckpointError, never code:

    {"format": 3, "dcp_version": "1.0.0",
     "tensors": {"model.w": {"dtype": "float32", "size": [4, 3], "requires_grad": false,
                             "chunks": [{"offsets": [0, 0], "sizes": [4, 3]}]}},
     "extents": [{"key": "model.w", "offsets": [0, 0], "index": 0,
                  "file": "__0_0.distcp", "at": 0, "length": 48, "crc32": 31337}],
     "planner_data": {"model.w": ["model.w"]}}

The values beside the tensors (step, config, loss scale, LR scheduler, optimizer hyper-parameters)
go to `extra.json` through `encode`/`decode`: JSON's own types, with tuples, dicts with non-string
keys, bytes, dtypes and (small) tensors tagged so that they come back as they went in. A value of any
other type is refused when saving, naming where it is, rather than written and refused on load.
"""

from __future__ import annotations

import base64
import json
import numbers
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from varuna.errors import CheckpointError

__all__ = ["METADATA", "EXTRA", "metadata_json", "metadata_from_json", "encode", "decode"]

METADATA = "metadata.json"
EXTRA = "extra.json"

_DTYPE_NAMES = (
    "float64 float32 float16 bfloat16 complex64 complex128 int64 int32 int16 int8 uint64 uint32 uint16 uint8 "
    "bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz"
).split()
_DTYPES = {n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
_TAGS = ("$tuple", "$dict", "$bytes", "$dtype", "$tensor")


def _dtype_name(dtype: torch.dtype, where: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise CheckpointError(
            f"{where} has dtype {dtype}, which a checkpoint does not store (expected one of "
            f"{', '.join(sorted(_DTYPES))}); convert it before saving"
        )
    return name


def metadata_json(metadata: Metadata, storage_data: dict[MetadataIndex, Any], fmt: int) -> bytes:
    """DCP's `Metadata` of a save, with `storage_data` (index -> Extent), as the JSON of `metadata.json`."""
    tensors: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint entry {key!r} is not a tensor; only tensors are stored")
        tensors[key] = {
            "dtype": _dtype_name(md.properties.dtype, f"checkpoint entry {key!r}"),
            "size": list(md.size),
            "requires_grad": bool(md.properties.requires_grad),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    extents = [
        {
            "key": index.fqn,
            "offsets": list(index.offset) if index.offset is not None else None,
            "index": index.index,
            "file": e.relative_path,
            "at": e.offset,
            "length": e.length,
            "crc32": e.crc32,
        }
        for index, e in storage_data.items()
    ]
    planner = {k: [str(p) for p in v] for k, v in (metadata.planner_data or {}).items()}
    doc = {
        "format": fmt,
        "dcp_version": metadata.version,
        "tensors": tensors,
        "extents": extents,
        "planner_data": planner,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} is {value!r}, not a list of non-negative integers")
    return value


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is {value!r}, not a non-negative integer")
    return value


def metadata_from_json(path: Path, fmt: int, extent: Any) -> Metadata:
    """Rebuild DCP's `Metadata` from `path` (a `metadata.json`), every field checked; `extent` is
    the storage layer's Extent class (the per-item storage data)."""
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path.parent} has no {METADATA} (its metadata): it is not a complete checkpoint "
            f"of format {fmt}; resume from another one"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"checkpoint file {path} is not JSON ({type(exc).__name__}: {exc}); it is damaged or forged "
            "and is not read (a checkpoint's metadata is never unpickled); resume from another checkpoint"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(
            f"checkpoint file {path} has format {got}, this Varuna reads {fmt}; resume from a checkpoint "
            "this Varuna wrote"
        )
    try:
        state: dict[str, Any] = {}
        for key, t in doc["tensors"].items():
            if t["dtype"] not in _DTYPES:
                raise ValueError(f"{key!r} has dtype {t['dtype']!r}, not one of {sorted(_DTYPES)}")
            chunks = [
                ChunkStorageMetadata(
                    offsets=torch.Size(_ints(c["offsets"], f"{key!r} chunk offsets")),
                    sizes=torch.Size(_ints(c["sizes"], f"{key!r} chunk sizes")),
                )
                for c in t["chunks"]
            ]
            props = TensorProperties(dtype=_DTYPES[t["dtype"]], requires_grad=bool(t["requires_grad"]))
            state[key] = TensorStorageMetadata(props, torch.Size(_ints(t["size"], f"{key!r} size")), chunks)
        storage: dict[MetadataIndex, Any] = {}
        for e in doc["extents"]:
            if e["key"] not in state or not isinstance(e["file"], str):
                raise ValueError(f"extent {e!r} names no stored tensor or no file")
            if "/" in e["file"] or e["file"] in ("", ".", ".."):
                raise ValueError(f"extent of {e['key']!r} names {e['file']!r}, not a file of the checkpoint")
            offsets = None if e["offsets"] is None else torch.Size(_ints(e["offsets"], "extent offsets"))
            index = e["index"] if e["index"] is None else _int(e["index"], "extent index")
            storage[MetadataIndex(e["key"], offsets, index)] = extent(
                e["file"],
                _int(e["at"], "extent offset"),
                _int(e["length"], "extent length"),
                _int(e["crc32"], "CRC-32"),
            )
        planner = {k: [str(p) for p in v] for k, v in doc["planner_data"].items()}
        version = doc["dcp_version"]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint file {path} is damaged: {type(exc).__name__}: {exc}; resume from another checkpoint"
        ) from None
    return Metadata(
        state_dict_metadata=state,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version=version if isinstance(version, str) else None,
    )


def encode(value: Any, where: str = "extra") -> Any:
    """`value` as JSON-able data, tagging what JSON lacks; anything else is a CheckpointError naming `where`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"$tuple": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "$dict": [[encode(k, f"{where} key"), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]
        }
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {"$dtype": _dtype_name(value, where)}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "$tensor": {
                "dtype": _dtype_name(t.dtype, where),
                "shape": list(t.shape),
                "data": base64.b64encode(raw).decode(),
            }
        }
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a checkpoint does not store "
        "(it holds JSON values, tuples, bytes, dtypes and tensors, never a pickle); make the state_dict "
        "that holds it return plain values"
    )


def decode(value: Any) -> Any:
    """The inverse of `encode`; a malformed tag is a ValueError."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = next((t for t in _TAGS if t in value), None)
    if tag is None:
        return {k: decode(v) for k, v in value.items()}
    if len(value) != 1:
        raise ValueError(f"a tagged value holds more than {tag!r}: {sorted(value)}")
    body = value[tag]
    if tag == "$tuple":
        return tuple(decode(v) for v in body)
    if tag == "$dict":
        return {_hashable(decode(k)): decode(v) for k, v in body}
    if tag == "$bytes":
        return base64.b64decode(body, validate=True)
    if tag == "$dtype":
        return _DTYPES[body]
    dtype = _DTYPES[body["dtype"]]
    shape = [int(n) for n in body["shape"]]
    raw = bytearray(base64.b64decode(body["data"], validate=True))
    out = torch.empty(shape, dtype=dtype)
    if len(raw) != out.numel() * out.element_size():
        raise ValueError(f"a tensor of shape {shape} and {dtype} holds {len(raw)} bytes")
    if raw:
        out.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return out


def _hashable(key: Any) -> Any:
    if isinstance(key, (dict, list)):
        raise ValueError(f"a dict key is {type(key).__name__}")
    return key
