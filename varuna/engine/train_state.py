"""The engine's training state in a checkpoint: what `Varuna.checkpoint` saves and how it resumes.

`varuna.checkpoint.layout` is the layout (files, manifest, CRC-32s, tensors keyed by name); this module
says which tensors and values make an exact resume: this rank's parameters ("model.<name>"), its
optimizer state ("optim.<name>.<key>"), its RNG state ("rng.rank<r>"), and in `extra.json` the
step, the config, the loss scale, the LR scheduler and the optimizer's hyper-parameters and class.

For `varuna.consolidate` (one plain state dict from a checkpoint saved at any P x D) it also saves
this rank's real persistent buffers ("buffer.<state_dict key>") and, in `extra.json`, where every key
of the plain model's `state_dict()` comes from (`state_dict_layout`). Resume reads neither: it loads
only the keys it asks for.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from varuna._log import log
from varuna.checkpoint import layout as ckpt
from varuna.cut.partition import canonical_names
from varuna.engine.config import VarunaConfig
from varuna.engine.precision import LossScaler
from varuna.errors import CheckpointError


def state_dict_layout(
    model: nn.Module, params: list[tuple[str, nn.Parameter]]
) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """Where each key of the plain model's `state_dict()` is stored, and this rank's buffers to save.

    The layout maps a key to ["param", canonical name] (the tensor "model.<canonical name>"),
    ["buffer", key] (the tensor "buffer.<key>") or ["other", type name] (not a parameter or buffer,
    e.g. a module's extra state: not consolidated). It is the same on every rank: the engine
    replaces a stripped parameter by one meta Parameter per original, so an alias of a parameter
    another stage holds (`lm_head.weight` -> `transformer.wte.weight`) is still found by identity,
    and a stripped buffer keeps its key. The buffers are this rank's real (not meta) ones that
    `state_dict()` holds, i.e. the persistent ones; data-parallel copies are written once.
    """
    canon, _ = canonical_names(model)
    canon |= {id(p): n for n, p in params}
    buffer_ids = {id(b) for _, b in model.named_buffers(remove_duplicate=False)}
    layout: dict[str, list[str]] = {}
    buffers: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor) and id(value) in canon:
            layout[key] = ["param", canon[id(value)]]
        elif isinstance(value, torch.Tensor) and id(value) in buffer_ids:
            layout[key] = ["buffer", key]
            if not value.is_meta:
                buffers[f"buffer.{key}"] = value.detach()
        else:
            layout[key] = ["other", type(value).__name__]
    return layout, buffers


def save(
    root: Path,
    config: VarunaConfig,
    config_dict: dict[str, Any],
    *,
    step: int,
    rank: int,
    model: nn.Module,
    params: list[tuple[str, nn.Parameter]],
    optimizer: torch.optim.Optimizer | None,
    scaler: LossScaler | None,
    lr_scheduler: Any,
    blocking: bool = True,
    group: Any = None,
) -> tuple[Path, dict[str, Any] | PendingCheckpoint]:
    """Collective: save this rank's share under `root`; the checkpoint's path and its record
    (`Varuna.last_checkpoint`: path, bytes, seconds, step), or with `blocking=False` a
    `PendingCheckpoint` whose `wait()` gives the record.

    `model` is the whole (stripped) model, `params` the (canonical name, Parameter) this rank holds.
    Without `blocking` the state is copied first (to host memory; pinned from a GPU) and written by
    a background thread over `group` (a process group of its own), while training goes on; the
    commit is the same atomic one, so a crash during the write leaves the previous checkpoint latest.
    """
    t0 = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {f"model.{n}": p.detach() for n, p in params}
    layout, buffers = state_dict_layout(model, params)
    tensors |= buffers
    optim, groups = ckpt.optimizer_tensors(optimizer, params)
    tensors |= optim
    tensors[f"rng.rank{rank}"] = torch.get_rng_state()
    extra = {
        "format": ckpt.FORMAT,
        "step": step,
        "config": config_dict,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "optimizer_groups": groups,
        "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
        "world": {"pipeline": config.engine.pipeline, "data": config.engine.data},
        "state_dict": layout,
        "model": {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "parameters": sum(p.numel() for p in model.parameters()),
        },
    }
    keep = config.checkpoint.checkpoint_keep
    if not blocking:
        pending = PendingCheckpoint(
            root, step, _host_copy(tensors), copy.deepcopy(extra), rank, keep, group, t0
        )
        return pending.path, pending
    path, size = ckpt.save(root, step, tensors, extra, rank=rank, keep=keep)
    return path, {"path": str(path), "bytes": size, "seconds": time.perf_counter() - t0, "step": step}


def _host_copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of every tensor in host memory that training cannot change (pinned where it comes
    from a GPU, copied without blocking, then waited for once)."""
    out = {}
    for key, t in tensors.items():
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out[key] = host.copy_(t, non_blocking=True)
        else:
            out[key] = t.detach().clone()
    if torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values()):
        torch.cuda.synchronize()
    return out


class PendingCheckpoint:
    """A checkpoint being written by a background thread (`save(blocking=False)`); `wait()` joins
    it and returns its record, or raises its CheckpointError (the same on every rank)."""

    def __init__(
        self,
        root: Path,
        step: int,
        tensors: dict[str, torch.Tensor],
        extra: dict[str, Any],
        rank: int,
        keep: int,
        group: Any,
        started: float,
    ) -> None:
        self.step = step
        self.path = root / f"step-{step:08d}"
        self.copied_s = time.perf_counter() - started
        """Seconds the step spent copying the state (what a background checkpoint costs it)."""
        self._record: dict[str, Any] | None = None
        self._error: BaseException | None = None

        def write() -> None:
            try:
                path, size = ckpt.save(root, step, tensors, extra, rank=rank, keep=keep, group=group)
                self._record = {
                    "path": str(path),
                    "bytes": size,
                    "seconds": time.perf_counter() - started,
                    "step": step,
                    "blocking": False,
                    "copy_s": self.copied_s,
                }
            except BaseException as exc:  # surfaced by wait(), in the training thread
                self._error = exc

        self._thread = threading.Thread(target=write, name=f"varuna-checkpoint-{step}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether the write has ended (committed or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> dict[str, Any]:
        """Wait for the write; its record (path, bytes, seconds from the copy to the commit, step)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._record is not None
        return self._record


@dataclass(kw_only=True, slots=True)
class Resumed:
    """What a resume hands back to the engine."""

    step: int
    """The step the checkpoint was saved after."""
    pending_optimizer: tuple[dict[str, torch.Tensor], list[dict[str, Any]], Any]
    """Optimizer state tensors, its groups' hyper-parameters and the LR scheduler's state, applied
    once the script calls `set_optimizer`."""
    optimizer_class: str | None
    """The saved optimizer's class name, which `set_optimizer` checks."""
    info: dict[str, Any]
    """`Varuna.resume_info`: path, step, seconds, bytes."""


def resume(
    path: Path,
    config: VarunaConfig,
    *,
    rank: int,
    world_size: int,
    param_shapes: dict[str, tuple[int, ...]],
    params: list[tuple[str, nn.Parameter]],
    scaler: LossScaler | None,
) -> Resumed:
    """Collective: check the checkpoint at `path` (on rank 0, the verdict broadcast), load this
    rank's parameters, optimizer state and RNG state from it, and restore the loss scale."""
    t0 = time.perf_counter()
    problem: list[Any] = [None]
    if rank == 0:
        try:
            ckpt.verify(path)
        except CheckpointError as exc:
            problem[0] = str(exc)
    if world_size > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise CheckpointError(problem[0])
    extra = ckpt.read_extra(path)
    saved_batch = extra["config"]["global_batch_size"]
    if saved_batch != config.engine.global_batch_size and not config.checkpoint.allow_batch_change:
        raise CheckpointError(
            f"checkpoint {path} was trained with global_batch_size={saved_batch}, this run asks for "
            f"{config.engine.global_batch_size}; a morph keeps the global batch so that the run stays the same "
            "training. Use the same global_batch_size, or pass allow_batch_change=True to change it knowingly."
        )
    stored = ckpt.stored_tensors(path)
    ckpt.check_model(stored, param_shapes, path)
    tensors: dict[str, torch.Tensor] = {f"model.{n}": p.data for n, p in params}
    optim = ckpt.optimizer_placeholders(stored, params)
    rng_key = f"rng.rank{rank}"
    if rng_key in stored:
        tensors[rng_key] = torch.empty(stored[rng_key][0], dtype=stored[rng_key][1])
    # Every rank reads its own tensors: replica 0 reading once per stage and broadcasting costs more
    # in gloo broadcasts than the shared read saves (docs/benchmarks/findings.md).
    ckpt.load_tensors(path, tensors | optim)
    if rng_key in tensors:
        torch.set_rng_state(tensors[rng_key])
    step = int(extra["step"])
    if scaler is not None and extra.get("scaler"):
        scaler.load_state_dict(extra["scaler"])
    info = {
        "path": str(path),
        "step": step,
        "seconds": time.perf_counter() - t0,
        "bytes": int(json.loads((path / "manifest.json").read_text())["bytes"]),
    }
    if rank == 0:
        log.info("varuna: resumed from %s at step %d", path, step)
    return Resumed(
        step=step,
        pending_optimizer=(optim, extra.get("optimizer_groups") or [], extra.get("lr_scheduler")),
        optimizer_class=extra.get("optimizer_class"),
        info=info,
    )
