"""`patched_environ`: environment variables set (or removed) for a block, put back afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["patched_environ"]


@contextlib.contextmanager
def patched_environ(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Set each variable of `changes` (None: remove it) for the block; restore every one after,
    including those the block itself changed."""
    saved = {k: os.environ.get(k) for k in changes}
    for k, v in changes.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
