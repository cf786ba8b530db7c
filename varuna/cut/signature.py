"""`model_signature`: which architecture a profile or a checkpoint belongs to."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["model_signature"]


def model_signature(model: Any) -> str:
    """A short hash of a model's parameter names and shapes, in registration order.

    `model` is an `nn.Module` (anything with `named_parameters()`) or an iterable of
    `(name, shape)` pairs; two models with the same architecture give the same signature.
    """
    if hasattr(model, "named_parameters"):
        pairs: Iterable[tuple[str, Sequence[int]]] = ((n, p.shape) for n, p in model.named_parameters())
    else:
        pairs = model
    text = json.dumps([[str(n), [int(d) for d in shape]] for n, shape in pairs])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
