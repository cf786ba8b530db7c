"""Atomic file writes: a reader (the launcher, a resuming rank, the controller) never sees half a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["write_atomic", "write_json_atomic"]


def write_atomic(path: Path, data: bytes, *, fsync: bool = False) -> Path:
    """Write `data` to a hidden temporary beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path, payload: Any, *, fsync: bool = False) -> Path:
    """`payload` as indented JSON (unknown types via str), written atomically."""
    return write_atomic(path, (json.dumps(payload, indent=1, default=str) + "\n").encode(), fsync=fsync)
