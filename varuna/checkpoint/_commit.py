"""Committing a written checkpoint on rank 0: the small files, one rename, `latest`, retention.

The order makes every state a kill or a full disk can leave a usable one:

    .step-N.tmp/  data files (every rank, fsynced)  ->  extra.json, manifest.json (fsynced)
    .latest.tmp   "step-N"  (fsynced)                    every byte that needs space is on disk now
    rename .step-N.tmp -> step-N   (a re-save: swapped with the old step-N in one RENAME_EXCHANGE)
    rename .latest.tmp -> latest                          committed
    remove the old step-N (after a swap); retention: keep step-N and the newest others

A failure before the first rename removes `.step-N.tmp` and `.latest.tmp` and leaves `latest` on
the previous checkpoint. Retention never removes the checkpoint just committed (which `latest`
names), even when higher-numbered ones exist, e.g. after resuming from an older one.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from varuna.checkpoint import _plain
from varuna.checkpoint import storage as cio

__all__ = ["commit", "checkpoint_names", "remove", "NAME", "SMALL"]

NAME = re.compile(r"step-[0-9]{8,}")
"""A committed checkpoint's directory name; `latest` holds one, and nothing else is followed."""
SMALL = (_plain.METADATA, _plain.EXTRA)
"""The small files, whose CRC-32 the manifest holds (the data files' extents have their own)."""


def checkpoint_names(root: Path) -> list[str]:
    """Committed checkpoints under `root` (real directories named step-N), oldest first."""
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(names, key=lambda n: int(n[len("step-") :]))


def remove(path: Path) -> None:
    """Remove a directory tree, or the symbolic link (never what it points to)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _libc_renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: Path, b: Path) -> bool:
    """Swap `a` and `b` in one atomic rename (Linux renameat2); False where that is not supported."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this file system cannot: rename instead
        return False
    raise OSError(err, os.strerror(err), str(b))


def commit(root: Path, tmp: Path, name: str, step: int, extra_json: bytes, *, fmt: int, keep: int) -> int:
    """Rank 0, once every data file in `tmp` is durable: commit it as `root/name`; returns its bytes.

    A failure is a CheckpointError (`storage.write_failed`) with `tmp` and `.latest.tmp` removed.
    """
    pointer, final, aside = root / ".latest.tmp", root / name, root / f".{name}.old"
    writing = tmp / _plain.EXTRA
    try:
        _write_durably(writing, extra_json)
        files: dict[str, Any] = {p.name: {"bytes": p.stat().st_size} for p in sorted(tmp.glob("*.distcp"))}
        for fname in SMALL:
            p = tmp / fname
            files[fname] = {"bytes": p.stat().st_size, "crc32": cio.file_crc(p)}
        size = sum(f["bytes"] for f in files.values())
        manifest = {
            "format": fmt,
            "step": step,
            "created": time.time(),
            "files": files,
            "bytes": size,
            "checksums": "crc32 of the small files here; of every tensor's bytes in metadata.json",
        }
        writing = tmp / "manifest.json"
        _write_durably(writing, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
        writing = pointer  # written now and renamed after: committing needs no disk space
        _write_durably(writing, (name + "\n").encode())
        writing = final
        if not os.path.lexists(final):
            os.replace(tmp, final)
        elif not exchange(tmp, final):  # no RENAME_EXCHANGE here: a short window without `final`
            remove(aside)
            os.replace(final, aside)
            os.replace(tmp, final)
        writing = root / "latest"
        os.replace(pointer, writing)
        _fsync_dir(root)
    except OSError as exc:
        if not os.path.lexists(final) and os.path.lexists(aside):
            os.replace(aside, final)  # the old copy back where it was
        remove(tmp)
        pointer.unlink(missing_ok=True)
        raise cio.write_failed(writing, exc) from None
    remove(tmp)  # after a swap: the checkpoint this one replaced
    remove(aside)
    others = [n for n in checkpoint_names(root) if n != name]
    for old in others[: max(0, len(others) - (keep - 1))] if keep > 0 else []:
        remove(root / old)
    return size
