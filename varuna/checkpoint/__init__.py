"""Checkpoints keyed by parameter name: the layout (files, manifest, `latest`), the storage of
raw tensor bytes with CRC-32s, and consolidation into one state dict of the plain model.
Nothing in a checkpoint is a pickle: metadata and extra values are JSON."""

from __future__ import annotations

from varuna._lazy import lazy_exports

_WHERE = {
    "CheckpointConfig": "config",
    "save": "layout",
    "resolve": "layout",
    "latest": "layout",
    "verify": "layout",
    "read_extra": "layout",
    "load_tensors": "layout",
    "stored_tensors": "layout",
    "checkpoint_names": "layout",
    "FORMAT": "layout",
    "consolidate": "consolidation",
    "find_checkpoint": "consolidation",
}
__all__ = sorted(_WHERE)
__getattr__, __dir__ = lazy_exports(__name__, _WHERE)
