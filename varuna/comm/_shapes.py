"""What describes a value at a cut (its header and signature) and what predicts it (the batch's key).

A header is the wire form of a value's shapes, a signature the host form of the same facts:

    header     [is_tuple, n, dtype_0, ndim_0, d0, d1, ..., dtype_1, ndim_1, ...]   (HEADER_LEN int64)
    signature  (is_tuple, ((dtype_0, shape_0), (dtype_1, shape_1), ...))

A micro-batch's key holds the shapes and dtypes of its tensors and the values of its scalars: what a
cut's shapes are expected to follow (`varuna.comm.p2p`: a micro-batch whose key is the one it had in
the previous step sends its activation with no header).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from varuna.errors import ConfigError, PartitionError

__all__ = [
    "HEADER_LEN",
    "Signature",
    "encode_header",
    "encode_signature",
    "decode_header",
    "decode_signature",
    "describe",
    "empty",
    "signature",
    "batch_key",
    "headers_every",
]

HEADER_LEN = 64
_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_CODE = {dt: i for i, dt in enumerate(_DTYPES)}

Signature = tuple[bool, tuple[tuple[torch.dtype, tuple[int, ...]], ...]]
"""(is_tuple, ((dtype, shape), ...)): the shapes of a value at a cut, comparable on the host."""


def signature(tensors: list[torch.Tensor], is_tuple: bool) -> Signature:
    """The host-side description of a cut value; PartitionError for a dtype no header can carry."""
    for t in tensors:
        if t.dtype not in _CODE:
            raise PartitionError(f"cannot send a {t.dtype} tensor across a cut; supported: {_DTYPES}")
    return is_tuple, tuple((t.dtype, tuple(t.shape)) for t in tensors)


def encode_header(tensors: list[torch.Tensor], is_tuple: bool) -> torch.Tensor:
    """The header of a cut value (on the CPU)."""
    return encode_signature(signature(tensors, is_tuple))


def encode_signature(sig: Signature) -> torch.Tensor:
    is_tuple, specs = sig
    fields = [int(is_tuple), len(specs)]
    for dtype, shape in specs:
        fields += [_CODE[dtype], len(shape), *shape]
    if len(fields) > HEADER_LEN:
        raise PartitionError(
            f"the value at a cut has too many tensors or dimensions to describe in {HEADER_LEN} slots "
            f"({len(specs)} tensors); pass fewer tensors through the CutPoint"
        )
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[list[tuple[torch.dtype, tuple[int, ...]]], bool]:
    """(specs, is_tuple) of a header: each tensor's dtype and shape."""
    fields = header.tolist()
    is_tuple, n = bool(fields[0]), fields[1]
    specs, pos = [], 2
    for _ in range(n):
        dtype, ndim = _DTYPES[fields[pos]], fields[pos + 1]
        shape = tuple(fields[pos + 2 : pos + 2 + ndim])
        specs.append((dtype, shape))
        pos += 2 + ndim
    return specs, is_tuple


def decode_signature(header: torch.Tensor) -> Signature:
    specs, is_tuple = decode_header(header)
    return is_tuple, tuple(specs)


def describe(sig: Signature | None) -> str:
    """A signature as the errors show it: ``float32 (2, 8, 32)``, a tuple's in parentheses."""
    if sig is None:
        return "none"
    text = ", ".join(f"{str(dtype).removeprefix('torch.')} {tuple(shape)}" for dtype, shape in sig[1])
    return f"({text})" if sig[0] else text


def empty(sig: Signature, device: torch.device) -> list[torch.Tensor]:
    """Receive buffers for a value of signature `sig`."""
    return [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in sig[1]]


def batch_key(batch: Mapping[str, Any]) -> Hashable:
    """What a micro-batch's cut shapes are expected to follow: its tensors' dtypes and shapes and
    its scalars' values. Any other value (a list of strings, an object) makes a key equal to no
    other, so such a micro-batch always sends its activations with a header."""
    return tuple((name, _value_key(v)) for name, v in batch.items())


def _value_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape)
    if value is None or isinstance(value, (bool, int, float, str)):
        return type(value).__name__, value
    return object()  # unknown: never "unchanged"


def headers_every() -> bool:
    """VARUNA_P2P_HEADERS=every: a header with every activation, for a model whose cut shapes change
    while its batch's do not; "step" (the default) sends one only when the batch's shapes change."""
    mode = os.environ.get("VARUNA_P2P_HEADERS", "step")
    if mode not in ("step", "every"):
        raise ConfigError(f"VARUNA_P2P_HEADERS={mode!r}; use 'step' (the default) or 'every'")
    return mode == "every"
