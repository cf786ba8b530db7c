"""Checkpoints keyed by parameter name, so one saved at P x D loads at any P' x D'.

Layout under the run directory:

    checkpoints/
      step-00000012/            a committed checkpoint (renamed from .step-00000012.tmp when complete)
        .metadata               torch.distributed.checkpoint's metadata: every key's shape and dtype,
                                and where its bytes lie (file, offset, length, CRC-32 of the bytes)
        __R_0.distcp            rank R's tensors, "model.<name>", "optim.<name>.<key>", "rng.rank<r>",
                                "buffer.<state_dict key>", their raw bytes one after the other —
                                replicated copies (data parallel, tied) written once
        extra.pt                step, config, loss scale, LR scheduler, optimizer hyper-parameters,
                                the model's state_dict layout (for varuna.consolidate)
        manifest.json           every file with its size (and CRC-32 of the small ones), written last
      latest                    the name of the newest committed checkpoint, replaced atomically

A kill at any moment leaves `latest` on a complete checkpoint: the data goes to a temporary
directory, the manifest is written after every byte is fsynced, the directory is renamed, and
only then is `latest` replaced. Loading checks the manifest on one rank (every file there with
its size, `.metadata` and `extra.pt` matching their CRC-32), then every tensor's bytes as they
are read, against the CRC-32 computed from memory when they were written (see
`varuna.checkpoint.storage`): a truncated or damaged file fails the load on every rank, naming it.
`verify(path, deep=True)` checks every byte of every file without loading.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from varuna._files import write_atomic
from varuna.checkpoint import storage as cio
from varuna.errors import CheckpointError

__all__ = ["save", "resolve", "verify", "read_extra", "load_tensors", "checkpoint_names", "FORMAT"]

FORMAT = 2
"""2: raw tensor bytes with a CRC-32 per extent (1 was DCP's torch.save records, CRC-32 per file)."""
_SMALL = (".metadata", "extra.pt")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_names(root: Path) -> list[str]:
    """Committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def save(
    root: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    extra: dict[str, Any],
    *,
    rank: int,
    keep: int,
) -> tuple[Path, int]:
    """Collective: write one checkpoint and commit it; returns its path and its size in bytes."""
    name = f"step-{step:08d}"
    tmp = root / f".{name}.tmp"
    final = root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    # Every rank's data file is written and fsynced, and rank 0 has written .metadata (with the
    # extents' CRC-32s, fsynced too), when dcp.save returns.
    with cio.dcp_errors(f"checkpoint {tmp} could not be written"):
        dcp.save(tensors, storage_writer=cio.Writer(tmp))
    size = 0
    if rank == 0:
        torch.save(extra, tmp / "extra.pt")
        files: dict[str, Any] = {p.name: {"bytes": p.stat().st_size} for p in sorted(tmp.glob("*.distcp"))}
        for fname in _SMALL:
            p = tmp / fname
            files[fname] = {"bytes": p.stat().st_size, "crc32": cio.file_crc(p)}
        size = sum(f["bytes"] for f in files.values())
        manifest = {
            "format": FORMAT,
            "step": step,
            "created": time.time(),
            "files": files,
            "bytes": size,
            "checksums": "crc32 of the small files here; of every tensor's bytes in .metadata",
        }
        with open(tmp / "extra.pt", "rb") as f:  # DCP's writer fsyncs its own files
            os.fsync(f.fileno())
        write_atomic(tmp / "manifest.json", json.dumps(manifest, indent=1).encode(), fsync=True)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_atomic(root / "latest", (name + "\n").encode(), fsync=True)
        _fsync_dir(root)
        for old in checkpoint_names(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(root / old, ignore_errors=True)
    box = [size]
    dist.broadcast_object_list(box, src=0)
    return final, int(box[0])


def resolve(resume: str | os.PathLike[str], run_dir: Path | None) -> Path | None:
    """The checkpoint directory `resume` names: "latest" (None if there is none yet) or a path."""
    if str(resume) == "latest":
        if run_dir is None:
            raise CheckpointError(
                'resume="latest" needs a run directory (run_dir=... or `varuna run --run-dir`) to look in'
            )
        pointer = run_dir / "checkpoints" / "latest"
        if not pointer.exists():
            return None
        return run_dir / "checkpoints" / pointer.read_text().strip()
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} does not exist (resume= takes 'latest' or a checkpoint directory)"
        )
    return path


def verify(path: Path, *, deep: bool = False) -> dict[str, Any]:
    """Check the manifest against the files on disk; returns the manifest.

    Every file must be there with the size the manifest gives, and the small files (`.metadata`,
    `extra.pt`) must match their CRC-32. The tensors' bytes are checked as they are loaded (see
    the module docstring); `deep=True` reads every data file here and checks every extent.
    """
    manifest_path = path / "manifest.json"
    if not manifest_path.exists():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no manifest.json (it was not committed; "
            "resume from another one, e.g. the directory named in checkpoints/latest)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: manifest.json is not valid JSON ({exc})") from exc
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {manifest.get('format')}, this Varuna reads {FORMAT} "
            "(resave it with the Varuna that wrote it, or start without resume=)"
        )
    for fname, info in manifest["files"].items():
        f = path / fname
        if not f.exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: {f} is missing")
        actual = f.stat().st_size
        if actual != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {f} is truncated or damaged: {actual} bytes, the manifest says {info['bytes']}"
            )
        if "crc32" in info and cio.file_crc(f) != info["crc32"]:
            raise CheckpointError(f"checkpoint file {f} is corrupted: its CRC-32 does not match the manifest")
    if deep:
        cio.verify_extents(path, manifest)
    return manifest


def read_extra(path: Path) -> dict[str, Any]:
    try:
        extra = torch.load(path / "extra.pt", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint file {path / 'extra.pt'} cannot be read: {exc}") from exc
    if extra.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {extra.get('format')}, this Varuna reads {FORMAT}"
        )
    return extra


def stored_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of every tensor in the checkpoint."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, dcp.TensorStorageMetadata):
            out[key] = (tuple(md.size), md.properties.dtype)
    return out


def load_tensors(path: Path, tensors: Mapping[str, torch.Tensor], *, process_group: Any = None) -> None:
    """Collective over `process_group` (default: all ranks): fill `tensors` in place from the checkpoint.

    A damaged extent fails the load on every rank with the same CheckpointError naming the file.
    Without an initialised process group it reads in this process alone, checking every extent it
    reads (`varuna.consolidate` reads a checkpoint so, outside any job).
    """
    with cio.dcp_errors(f"checkpoint {path} could not be read"), warnings.catch_warnings():
        # Without a process group DCP reads alone and warns that it assumes so; that is the intent.
        warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")
        dcp.load(dict(tensors), storage_reader=cio.Reader(path), process_group=process_group)


# ---------------------------------------------------------------------------------------------------
# What an engine puts in a checkpoint, keyed by parameter name.


def _names_by_id(named: list[tuple[str, torch.nn.Parameter]]) -> dict[int, str]:
    return {id(p): n for n, p in named}


def optimizer_tensors(
    optimizer: torch.optim.Optimizer | None, named: list[tuple[str, torch.nn.Parameter]]
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The optimizer's state as "optim.<param name>.<key>" tensors, and its hyper-parameters."""
    if optimizer is None:
        return {}, []
    names = _names_by_id(named)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value)
                out[f"optim.{names[id(p)]}.{key}"] = value
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return out, groups


def optimizer_placeholders(
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]], named: list[tuple[str, torch.nn.Parameter]]
) -> dict[str, torch.Tensor]:
    """Empty tensors for the stored optimizer state of the parameters this rank holds."""
    out = {}
    for name, p in named:
        prefix = f"optim.{name}."
        for key, (shape, dtype) in stored.items():
            if key.startswith(prefix) and "." not in key[len(prefix) :]:
                device = p.device if len(shape) else torch.device("cpu")
                out[key] = torch.empty(shape, dtype=dtype, device=device)
    return out


def apply_optimizer_state(
    optimizer: torch.optim.Optimizer,
    named: list[tuple[str, torch.nn.Parameter]],
    tensors: dict[str, torch.Tensor],
    groups: list[dict[str, Any]],
) -> None:
    """Install state loaded by name into `optimizer` (built over this rank's parameters)."""
    names = _names_by_id(named)
    if groups and len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} parameter groups, this one {len(optimizer.param_groups)}; "
            "build the optimizer with the same groups as the run that saved it"
        )
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(saved)
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"optim.{names[id(p)]}."
            state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
            if state:
                optimizer.state[p] = state


def check_model(
    stored: dict[str, tuple[tuple[int, ...], torch.dtype]], shapes: dict[str, tuple[int, ...]], path: Path
) -> None:
    """The checkpoint holds exactly this model's parameters, with the same shapes."""
    saved = {k[len("model.") :]: v[0] for k, v in stored.items() if k.startswith("model.")}
    missing = sorted(set(shapes) - set(saved))
    unexpected = sorted(set(saved) - set(shapes))
    wrong = sorted(n for n in set(shapes) & set(saved) if tuple(shapes[n]) != tuple(saved[n]))
    if missing or unexpected or wrong:
        lines = [f"checkpoint {path} is from a different model:"]
        for what, names, show in (
            ("missing from the checkpoint", missing, lambda n: f"{n} {tuple(shapes[n])}"),
            ("not in this model", unexpected, lambda n: f"{n} {tuple(saved[n])}"),
            (
                "shape differs",
                wrong,
                lambda n: f"{n} model {tuple(shapes[n])} vs checkpoint {tuple(saved[n])}",
            ),
        ):
            lines += [f"  {what}: {show(n)}" for n in names[:20]]
            if len(names) > 20:
                lines.append(f"  ... and {len(names) - 20} more {what}")
        raise CheckpointError("\n".join(lines))
