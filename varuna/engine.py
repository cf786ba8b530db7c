"""`Varuna`: this rank's stage of a pipeline x data-parallel job, and its training step.

    engine = Varuna(model, global_batch_size=32, micro_batch_size=4, example_batch=batch)
    # or Varuna(model, global_batch_size=32, pipeline="auto", example_batch=batch): see varuna._auto
    opt = torch.optim.AdamW(engine.parameters(), lr=3e-4)
    engine.set_optimizer(opt)
    for step in range(n):
        loss = engine.step(engine.batch(dataset, step))   # same mean loss on every rank

Construction traces one forward of the whole model to learn the CutPoint order and which
parameters each segment uses, chooses the stage boundaries (balanced by a measured profile by
default), frees every parameter this rank's stage does not hold (they become meta tensors), and
makes the process groups: one per stage across replicas for the data-parallel all-reduce, one
per tied weight across its holders.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from varuna import checkpoint as ckpt
from varuna import distributed as vdist
from varuna._files import write_json_atomic
from varuna.comm import P2P, GradBuckets
from varuna.config import VarunaConfig
from varuna.costs import model_signature
from varuna.cutpoint import SKIPPED, CutPoint
from varuna.errors import CheckpointError, ConfigError
from varuna.morph import MORPH_EXIT, StopRequest
from varuna.partition import (
    Partition,
    Trace,
    canonical_names,
    cut_names,
    make_partition,
    profile_segments,
    trace_model,
)
from varuna.precision import LossScaler, autocast_policy
from varuna.runtime import StageRuntime, StepTimes
from varuna.schedule import Action, lower, make_schedule, validate
from varuna.telemetry import Telemetry  # telemetry

__all__ = ["Varuna"]


def _skip_forward(*args: Any, **kwargs: Any) -> Any:
    return SKIPPED


def _device() -> torch.device:
    """The device seam: the rank's CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slice_batch(
    batch: Mapping[str, Any], start: int, stop: int, device: torch.device | None = None
) -> dict[str, Any]:
    return {
        k: (v[start:stop] if device is None else v[start:stop].to(device, non_blocking=True))
        if isinstance(v, torch.Tensor)
        else v
        for k, v in batch.items()
    }


def _batch_len(batch: Mapping[str, Any]) -> int:
    lengths = {k: v.shape[0] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if not lengths:
        raise ConfigError("a batch must be a dict holding at least one tensor with a batch dimension")
    if len(set(lengths.values())) > 1:
        raise ConfigError(f"the batch's tensors disagree on the batch dimension: {lengths}")
    return next(iter(lengths.values()))


class Varuna:
    """This rank's pipeline stage, and `step(batch)` running one optimizer step over all stages."""

    def __init__(
        self,
        model: nn.Module,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        pipeline: int | Literal["auto"] | None = None,
        data: int | None = None,
        schedule: str | None = None,
        precision: str = "fp32",
        shared_weights: Sequence[Sequence[str]] | None = None,
        partition: str | Sequence[int] = "balanced",
        recompute: bool | None = None,
        clip_grad_norm: float | None = None,
        example_batch: Mapping[str, Any] | None = None,
        run_dir: str | Path | None = None,
        resume: str | Path | None = None,
        **options: Any,
    ) -> None:
        env = vdist.launch_env()
        self.rank, self.world_size = vdist.init_distributed()
        self.plan_info: dict[str, Any] | None = None  # pipeline="auto": how it was chosen (engine.json)
        if pipeline == "auto":
            from varuna._auto import Fixed, choose

            auto = choose(
                model,
                rank=self.rank,
                world=self.world_size,
                global_batch_size=global_batch_size,
                fixed=Fixed(
                    micro_batch_size=micro_batch_size, data=data, schedule=schedule, recompute=recompute
                ),
                precision=precision,
                example_batch=example_batch,
                run_dir=Path(run_dir) if run_dir is not None else env.run_dir,
                partition=partition,
                options=options,
            )
            pipeline, data, micro_batch_size = auto.pipeline, auto.data, auto.micro_batch_size
            schedule, recompute, partition, self.plan_info = (
                auto.schedule,
                auto.recompute,
                auto.boundaries,
                auto.info,
            )
        if micro_batch_size is None:
            raise ConfigError(
                "micro_batch_size is required (or pass pipeline='auto' to let the planner choose it)"
            )
        pipeline = pipeline if pipeline is not None else (env.pipeline or 1)
        if data is None:
            data = env.data if env.data is not None else max(self.world_size // max(pipeline, 1), 1)
        self.config = VarunaConfig(
            pipeline=pipeline,
            data=data,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            schedule=schedule or "1f1b",  # type: ignore[arg-type]
            precision=precision,  # type: ignore[arg-type]
            shared_weights=tuple(tuple(g) for g in (shared_weights or ())),
            partition=partition if isinstance(partition, str) else tuple(partition),  # type: ignore[arg-type]
            recompute=recompute,
            clip_grad_norm=clip_grad_norm,
            run_dir=Path(run_dir) if run_dir is not None else env.run_dir,
            resume=resume if resume is not None else os.environ.get("VARUNA_RESUME") or None,
            **options,
        )
        cfg = self.config
        P, D = cfg.pipeline, cfg.data
        if self.world_size != P * D:
            raise ConfigError(
                f"the job has {self.world_size} processes but pipeline x data = {P} x {D} = {P * D}; launch "
                f"with `varuna run --pipeline {P} --data {D} ...` ({P * D} processes), or pass pipeline/data "
                f"that multiply to {self.world_size}"
            )
        self.stage, self.replica = vdist.placement(self.rank, P)
        self.where = f"rank {self.rank} (stage {self.stage}, replica {self.replica})"
        self.device = _device()
        self.autocast = autocast_policy(cfg.precision, self.device.type)
        self.scaler = LossScaler(cfg.init_loss_scale) if cfg.precision == "fp16" else None
        self.model = model

        self.trace = self._trace(model, example_batch)
        self.partition = self._partition(model, example_batch)
        owned = set(self.partition.stage_params[self.stage])
        self._strip(model, owned)
        self._to_device(model)
        self._params = self._owned_parameters(model)
        self._make_groups()
        self._resume_path = ckpt.resolve(cfg.resume, cfg.run_dir) if cfg.resume is not None else None
        if self._resume_path is None:  # a checkpoint overwrites every value anyway
            self._broadcast_initial_values()

        tied_names = {n for g in self.partition.tied for n in g.names}
        by_name = dict(self._params)
        self._buckets = GradBuckets(
            [p for n, p in self._params if n not in tied_names], bucket_bytes=int(cfg.bucket_mb * 2**20)
        )
        self._tied_local = [
            (g, pg, [by_name[n] for n in g.names if n in by_name])
            for g, pg, _ in self._tied_groups
            if self.stage in g.stages
        ]

        compute = make_schedule(cfg.schedule, P, cfg.num_microbatches, recompute=cfg.recompute)  # type: ignore[arg-type]
        lowered = lower(compute)
        validate(lowered, P, cfg.num_microbatches)
        self.schedule = lowered
        self.actions: list[Action] = lowered[self.stage]
        prev_rank = self.rank - 1 if self.stage > 0 else None
        next_rank = self.rank + 1 if self.stage < P - 1 else None
        self._p2p = P2P(prev_rank, next_rank, self.device)
        names = cut_names(model)
        position = {name: i for i, name in enumerate(self.trace.cut_names)}
        index_of = {mid: position.get(name, -1) for mid, name in names.items()}
        self._runtime = StageRuntime(
            model,
            stage=self.stage,
            num_stages=P,
            cut_index=index_of,
            cut_names=self.trace.cut_names,
            start_cut=self.partition.start_cut(self.stage),
            end_cut=self.partition.end_cut(self.stage),
            p2p=self._p2p,
            autocast=self.autocast,
            recompute=cfg.uses_recompute,
            opportunistic=cfg.schedule == "varuna",
            where=self.where,
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.step_count = 0
        self.last_step_skipped = False
        self.last_grad_norm: float | None = None
        self.last_times: StepTimes | None = None
        self.history: list[dict[str, float]] = []
        self.stop_request = StopRequest()
        self.stop_request.install()
        self.should_stop = False
        self._pending_optimizer: tuple[dict[str, torch.Tensor], list[dict[str, Any]], Any] | None = None
        self.resumed_from: Path | None = None
        self._morph_exit: Path | None = None
        self._saved_optimizer_class: str | None = None
        self.resume_info: dict[str, Any] | None = None
        self.last_checkpoint: dict[str, Any] | None = None
        if self._resume_path is not None:
            self._resume(self._resume_path)
        if self.rank == 0 and cfg.run_dir is not None:
            self._write_engine_info()
        self._telemetry = Telemetry.attach(self)  # telemetry: hello, ready; observes the runtime

    # construction ------------------------------------------------------------------------------
    def _example(self, example_batch: Mapping[str, Any] | None) -> dict[str, Any]:
        if example_batch is None:
            raise ConfigError(
                f"pipeline={self.config.pipeline} needs example_batch=: one batch dict, as given to step(), so "
                "Varuna can run a forward pass to find the CutPoints and what each stage uses"
            )
        return _slice_batch(example_batch, 0, self.config.micro_batch_size)

    def _trace(self, model: nn.Module, example_batch: Mapping[str, Any] | None) -> Trace:
        if self.config.pipeline == 1 and example_batch is None:
            _, aliases = canonical_names(model)
            shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
            return Trace(cut_names=[], param_segments={}, param_aliases=aliases, param_shapes=shapes)
        return trace_model(model, self._example(example_batch))

    def _partition(self, model: nn.Module, example_batch: Mapping[str, Any] | None) -> Partition:
        cfg = self.config
        boundaries = None if isinstance(cfg.partition, str) else list(cfg.partition)
        costs = None
        if boundaries is None and cfg.partition == "balanced" and cfg.pipeline > 1:
            costs = self._segment_costs(model, self._example(example_batch))
        return make_partition(
            self.trace,
            cfg.pipeline,
            boundaries=boundaries,
            segment_costs=costs,
            shared_weights=cfg.shared_weights,
        )

    def _segment_costs(self, model: nn.Module, micro: dict[str, Any]) -> list[float]:
        """Measured on rank 0 (cached in the run directory), broadcast so every rank agrees."""
        cfg = self.config
        key_src = json.dumps(
            {
                "params": sorted((n, list(s)) for n, s in self.trace.param_shapes.items()),
                "cuts": self.trace.cut_names,
                "batch": {k: list(v.shape) for k, v in micro.items() if isinstance(v, torch.Tensor)},
                "precision": cfg.precision,
                "threads": torch.get_num_threads(),
            },
            sort_keys=True,
        )
        key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
        cache = cfg.run_dir / "cache" / f"segments-{key}.json" if cfg.run_dir is not None else None
        box: list[Any] = [None]
        if self.rank == 0:
            if cache is not None and cache.exists():
                box[0] = json.loads(cache.read_text())["costs"]
            else:
                box[0] = profile_segments(model, micro, repeats=cfg.profile_repeats, autocast=self.autocast)
                if cache is not None:
                    write_json_atomic(cache, {"costs": box[0], "key": json.loads(key_src)})
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        return [float(c) for c in box[0]]

    def _strip(self, model: nn.Module, owned: set[str]) -> None:
        """Replace every parameter this stage does not hold by a meta tensor; skip modules left empty."""
        canon, _ = canonical_names(model)
        replaced: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for pname, p in list(module._parameters.items()):
                if p is None or canon[id(p)] in owned:
                    continue
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(
                        torch.empty_like(p, device="meta"), requires_grad=p.requires_grad
                    )
                module._parameters[pname] = replaced[id(p)]

        def visit(module: nn.Module) -> None:
            params = list(module.parameters())
            if params and all(p.is_meta for p in params) and not isinstance(module, CutPoint):
                module.forward = _skip_forward  # type: ignore[method-assign]
                for sub in module.modules():
                    for bname, b in list(sub._buffers.items()):
                        if b is not None:
                            sub._buffers[bname] = torch.empty_like(b, device="meta")
                return
            for child in module.children():
                visit(child)

        for child in model.children():
            visit(child)

    def _to_device(self, model: nn.Module) -> None:
        if self.device.type == "cpu":
            return
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                if not t.is_meta:
                    t.data = t.data.to(self.device)

    def _owned_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The real (not stripped) parameters, once each, under their first name."""
        out, seen = [], set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen or p.is_meta:
                continue
            seen.add(id(p))
            out.append((name, p))
        return out

    def _make_groups(self) -> None:
        """Every rank creates every group, in the same order (torch.distributed requires it)."""
        P, D = self.config.pipeline, self.config.data
        self._dp_group = None
        if D > 1:
            for s in range(P):
                group = dist.new_group([r * P + s for r in range(D)])
                if s == self.stage:
                    self._dp_group = group
        self._tied_groups: list[tuple[Any, Any, Any]] = []
        for g in self.partition.tied:
            ranks = [r * P + s for r in range(D) for s in g.stages]
            pg = dist.new_group(ranks) if len(ranks) > 1 else None
            self._tied_groups.append((g, pg, ranks))

    def _broadcast_initial_values(self) -> None:
        """Replica 0's values everywhere, and one value for every copy of a tied weight."""
        params = dict(self._params)
        with torch.no_grad():
            if self._dp_group is not None:
                for _, p in self._params:
                    dist.broadcast(p.data, src=self.stage, group=self._dp_group)
            for g, pg, _ranks in self._tied_groups:
                if self.stage not in g.stages:
                    continue
                local = [params[n] for n in g.names if n in params]
                if pg is not None:
                    dist.broadcast(local[0].data, src=g.stages[0], group=pg)
                for p in local[1:]:
                    p.copy_(local[0])

    # public API --------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this rank holds (give these to the optimizer)."""
        return (p for _, p in self._params)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._params)

    def set_optimizer(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> None:
        """Let `step()` run the optimizer (and scheduler), so fp16 overflow steps are skipped everywhere."""
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        if self._pending_optimizer is not None:
            saved_class = self._saved_optimizer_class
            if saved_class is not None and saved_class != type(optimizer).__name__:
                raise CheckpointError(
                    f"the checkpoint {self.resumed_from} was saved with a {saved_class} optimizer, this run gives "
                    f"{type(optimizer).__name__}; use the same optimizer to resume (or start without resume=)"
                )
            state, groups, scheduler_state = self._pending_optimizer
            ckpt.apply_optimizer_state(optimizer, self._params, state, groups)
            if lr_scheduler is not None and scheduler_state is not None:
                lr_scheduler.load_state_dict(scheduler_state)
            self._pending_optimizer = None

    def request_stop(self, reason: str = "request_stop()") -> None:
        """Ask every rank to stop after the current step (the morph protocol; see varuna.morph)."""
        self.stop_request.set(reason)

    def batch(self, dataset: Any, step: int, *, seed: int = 0, shuffle: bool = True) -> dict[str, Any]:
        """This replica's share of step `step`'s global batch from a map-style dataset."""
        from varuna.data import ReplicaLoader

        loader = ReplicaLoader(
            dataset,
            global_batch_size=self.config.global_batch_size,
            replica=self.replica,
            data_parallel=self.config.data,
            seed=seed,
            shuffle=shuffle,
        )
        return loader.batch(step)

    def step(self, batch: Mapping[str, Any]) -> float:
        """Forward and backward over this replica's micro-batches, reduce, step; the global mean loss."""
        cfg = self.config
        if self._morph_exit is not None:
            if self.rank == 0:
                reason = self.stop_request.reason or "by another rank"
                print(
                    f"varuna: stop requested ({reason}); checkpointed step {self.step_count} to "
                    f"{self._morph_exit}; exiting to morph",
                    flush=True,
                )
            raise SystemExit(MORPH_EXIT)
        t0 = time.perf_counter()
        local = cfg.global_batch_size // cfg.data
        n = _batch_len(batch)
        if n != local:
            raise ConfigError(
                f"step() got a batch of {n} samples but this replica's share of the global batch is "
                f"global_batch_size / data = {cfg.global_batch_size} / {cfg.data} = {local}; "
                "use engine.batch(dataset, step) or slice varuna.data.sample_indices(...)"
            )
        mbs, M = cfg.micro_batch_size, cfg.num_microbatches
        micro = [_slice_batch(batch, i * mbs, (i + 1) * mbs, self.device) for i in range(M)]
        self._buckets.zero_and_attach()
        for _, _, members in self._tied_local:
            for p in members:
                p.grad = None
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self._works: list[Any] = []
        losses, times = self._runtime.run(
            self.actions, micro, loss_coef=scale / M, allreduce=self._start_allreduce
        )
        t_wait = time.perf_counter()
        for w in self._works:
            w.wait()
        self._finish_tied()
        self._p2p.finish()
        grads = [p.grad for _, p in self._params if p.grad is not None]
        sumsq = self._local_sumsq()
        want_ckpt = self._telemetry.poll()  # telemetry: rank 0's controller commands (stop sets stop_request)
        # [loss, grad sum of squares, stop, checkpoint]: the one small all-reduce of every step
        flags = torch.tensor(
            [
                float(sum(losses)) / M if losses else 0.0,
                sumsq,
                float(bool(self.stop_request)),
                float(want_ckpt),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        if self.world_size > 1:
            dist.all_reduce(flags)
        times.comm_s += time.perf_counter() - t_wait
        loss, total_sq, stop = float(flags[0]) / cfg.data, float(flags[1]) / cfg.data, bool(flags[2] > 0)
        want_ckpt = bool(flags[3] > 0)  # telemetry: a controller's checkpoint command, agreed by all ranks
        self.should_stop = stop
        overflow = self.scaler is not None and not math.isfinite(total_sq)
        self.last_step_skipped = overflow
        if overflow:
            assert self.scaler is not None
            self.scaler.update(True)
            self.last_grad_norm = None
        else:
            norm = math.sqrt(total_sq) / scale
            self.last_grad_norm = norm
            coef = 1.0 / scale
            if cfg.clip_grad_norm is not None and norm > cfg.clip_grad_norm:
                coef *= cfg.clip_grad_norm / (norm + 1e-6)
            if coef != 1.0 and grads:
                torch._foreach_mul_(grads, coef)
            if self.optimizer is not None:
                t_opt = time.perf_counter()
                self.optimizer.step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                times.compute_s += time.perf_counter() - t_opt
            if self.scaler is not None:
                self.scaler.update(False)
        self.step_count += 1
        times.total_s = time.perf_counter() - t0
        self.last_times = times
        self.history.append(
            {
                "step": self.step_count,
                "loss": loss,
                "time_s": times.total_s,
                "compute_s": times.compute_s,
                "comm_s": times.comm_s,
                "idle_s": max(times.total_s - times.compute_s - times.comm_s, 0.0),
            }
        )
        if stop and cfg.on_stop == "exit":
            # Checkpoint now (a preempted VM has seconds), exit at the next step() so that the script
            # still sees this step's loss.
            self._morph_exit = self.checkpoint()
            self._telemetry.checkpoint_done(self.last_checkpoint, exiting=True)  # telemetry
        self._telemetry.on_step(loss, times)  # telemetry
        if want_ckpt and self._morph_exit is None:  # telemetry
            self.checkpoint()  # telemetry
            self._telemetry.checkpoint_done(self.last_checkpoint)  # telemetry
        return loss

    # checkpoints -------------------------------------------------------------------------------
    def checkpoint(self, root: str | Path | None = None) -> Path:
        """Collective: save everything an exact resume needs, keyed by parameter name; returns the path."""
        cfg = self.config
        if root is None:
            if cfg.run_dir is None:
                raise CheckpointError(
                    "checkpoint() needs a run directory (run_dir=... or `varuna run`) or a root"
                )
            root = cfg.run_dir / "checkpoints"
        t0 = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {f"model.{n}": p.detach() for n, p in self._params}
        optim, groups = ckpt.optimizer_tensors(self.optimizer, self._params)
        tensors |= optim
        tensors[f"rng.rank{self.rank}"] = torch.get_rng_state()
        extra = {
            "format": ckpt.FORMAT,
            "step": self.step_count,
            "config": self.config_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "optimizer_groups": groups,
            "optimizer_class": type(self.optimizer).__name__ if self.optimizer is not None else None,
            "world": {"pipeline": cfg.pipeline, "data": cfg.data},
        }
        path, size = ckpt.save(
            Path(root), self.step_count, tensors, extra, rank=self.rank, keep=cfg.checkpoint_keep
        )
        self.last_checkpoint = {
            "path": str(path),
            "bytes": size,
            "seconds": time.perf_counter() - t0,
            "step": self.step_count,
        }
        return path

    def _resume(self, path: Path) -> None:
        cfg = self.config
        t0 = time.perf_counter()
        problem: list[Any] = [None]
        if self.rank == 0:
            try:
                ckpt.verify(path)
            except CheckpointError as exc:
                problem[0] = str(exc)
        if self.world_size > 1:
            dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise CheckpointError(problem[0])
        extra = ckpt.read_extra(path)
        saved_batch = extra["config"]["global_batch_size"]
        if saved_batch != cfg.global_batch_size and not cfg.allow_batch_change:
            raise CheckpointError(
                f"checkpoint {path} was trained with global_batch_size={saved_batch}, this run asks for "
                f"{cfg.global_batch_size}; a morph keeps the global batch so that the run stays the same "
                "training. Use the same global_batch_size, or pass allow_batch_change=True to change it knowingly."
            )
        stored = ckpt.stored_tensors(path)
        ckpt.check_model(stored, self.trace.param_shapes, path)
        tensors: dict[str, torch.Tensor] = {f"model.{n}": p.data for n, p in self._params}
        optim = ckpt.optimizer_placeholders(stored, self._params)
        rng_key = f"rng.rank{self.rank}"
        if rng_key in stored:
            tensors[rng_key] = torch.empty(stored[rng_key][0], dtype=stored[rng_key][1])
        # Every rank reads its own tensors. (Replica 0 reading once per stage and broadcasting was
        # measured slower here: 4.4 s of gloo broadcasts for a 1.2 GB checkpoint against ~0 s saved.)
        ckpt.load_tensors(path, tensors | optim)
        if rng_key in tensors:
            torch.set_rng_state(tensors[rng_key])
        self.step_count = int(extra["step"])
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        self._pending_optimizer = (optim, extra.get("optimizer_groups") or [], extra.get("lr_scheduler"))
        self._saved_optimizer_class = extra.get("optimizer_class")
        self.resumed_from = path
        self.resume_info = {
            "path": str(path),
            "step": self.step_count,
            "seconds": time.perf_counter() - t0,
            "bytes": int(json.loads((path / "manifest.json").read_text())["bytes"]),
        }
        if self.rank == 0:
            print(f"varuna: resumed from {path} at step {self.step_count}", flush=True)

    def _write_engine_info(self) -> None:
        assert self.config.run_dir is not None
        info = self.config_dict() | {
            "num_segments": self.trace.num_segments,
            "boundaries": list(self.partition.boundaries),
            "step": self.step_count,
            "model_signature": model_signature(self.model),  # which profile fits (varuna resize --gpus)
            "plan": self.plan_info,
        }
        write_json_atomic(self.config.run_dir / "engine.json", info)

    # reductions --------------------------------------------------------------------------------
    def _start_allreduce(self) -> None:
        if self._dp_group is not None:
            self._works += self._buckets.allreduce_mean(self._dp_group, self.config.data)
        self._tied_sums = []
        for _, pg, members in self._tied_local:
            grads = [p.grad for p in members if p.grad is not None]
            if not grads:
                total = torch.zeros_like(members[0])
            elif len(grads) > 1:
                total = torch.stack(grads).sum(0)
            else:
                total = grads[0]  # reduced in place: it becomes this parameter's gradient again
            if pg is not None:
                total.div_(self.config.data)
                self._works.append(dist.all_reduce(total, group=pg, async_op=True))
            self._tied_sums.append(total)

    def _finish_tied(self) -> None:
        for (_, _, members), total in zip(self._tied_local, self._tied_sums):
            for p in members:
                p.grad = total.clone() if len(members) > 1 else total

    def _local_sumsq(self) -> float:
        """Squared norm of the gradients this rank contributes (a tied weight counted once); inf/nan
        propagate, which is the fp16 overflow check."""
        tensors = list(self._buckets.buffers)
        tensors += [t for (g, _, _), t in zip(self._tied_local, self._tied_sums) if self.stage == g.stages[0]]
        norms = torch._foreach_norm(tensors) if tensors else []
        return sum(float(n) ** 2 for n in norms)

    def close(self) -> None:
        """Release this engine's process groups (the default group stays for the next engine)."""
        self._p2p.close()
        groups = [self._dp_group] if self._dp_group is not None else []
        groups += [pg for _, pg, _ in self._tied_groups if pg is not None]
        for pg in groups:
            dist.destroy_process_group(pg)
        self._dp_group = None
        self._tied_groups = []

    # reporting ---------------------------------------------------------------------------------
    def describe(self) -> str:
        cfg = self.config
        planned = ""
        if self.plan_info is not None:
            from varuna._auto import describe

            planned = "\n" + describe(self.plan_info)
        return (
            f"Varuna {cfg.pipeline}x{cfg.data} ({cfg.schedule}, {cfg.precision}, {cfg.num_microbatches} micro-batches "
            f"of {cfg.micro_batch_size}) — {self.where}{planned}\n{self.partition.describe()}"
        )

    def config_dict(self) -> dict[str, Any]:
        d = asdict(self.config)
        for key in ("run_dir", "resume"):
            d[key] = str(d[key]) if d[key] is not None else None
        d["shared_weights"] = [list(g) for g in d["shared_weights"]]
        d["partition"] = d["partition"] if isinstance(d["partition"], str) else list(d["partition"])
        return d
