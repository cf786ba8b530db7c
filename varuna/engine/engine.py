"""`Varuna`: this rank's stage of a pipeline x data-parallel job, and its training step.

    engine = Varuna(model, global_batch_size=32, micro_batch_size=4, example_batch=batch)
    # or varuna.Varuna(model, global_batch_size=32, pipeline="auto", example_batch=batch): see varuna.auto
    opt = torch.optim.AdamW(engine.parameters(), lr=3e-4)
    engine.set_optimizer(opt)
    for step in range(n):
        loss = engine.step(engine.batch(dataset, step))   # same mean loss on every rank

Construction traces one forward of the whole model to learn the CutPoint order and which
parameters each segment uses, chooses the stage boundaries (balanced by a measured profile by
default), frees every parameter this rank's stage does not hold (they become meta tensors), and
makes the process groups: one per stage across replicas for the data-parallel all-reduce, one
per tied weight across its holders (`varuna.engine.stage`). What a checkpoint holds for an exact resume,
and the resume itself, are in `varuna.engine.train_state`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from varuna import _log
from varuna._files import write_json_atomic
from varuna._log import log
from varuna.checkpoint import layout as ckpt
from varuna.comm import rendezvous as vdist
from varuna.comm.buckets import GradBuckets
from varuna.cut.partition import cut_names
from varuna.data import batch_len, slice_batch
from varuna.elastic.protocol import MORPH_EXIT, StopRequest
from varuna.engine import nonfinite as _nonfinite
from varuna.engine import stage as _stage
from varuna.engine import train_state as _train_state
from varuna.engine.config import VarunaConfig
from varuna.engine.evaluate import Evaluation, MetricsFn
from varuna.engine.evaluate import evaluate as _evaluate
from varuna.engine.materialize import InitFn, is_meta, materialize, require_init
from varuna.engine.notice import Decision, NoticeWatch
from varuna.engine.observer import Observer
from varuna.engine.precision import LossScaler, autocast_policy
from varuna.engine.preflight import check as check_memory
from varuna.engine.preflight import rank_estimate
from varuna.engine.refit import OrderRefit
from varuna.engine.runtime import Chunk, StageRuntime, StepTimes
from varuna.errors import CheckpointError, ConfigError, check_int
from varuna.launch.notices import parse_duration
from varuna.metrics import MetricsLogger
from varuna.planner.costs import model_signature
from varuna.schedule import Action, build_schedule, forward_only, schedule_spec
from varuna.telemetry.recorder import Telemetry

__all__ = ["Varuna"]


def _device() -> torch.device:
    """The device seam: the rank's CUDA device under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _step_scheduler(scheduler: Any, loss: float) -> None:
    """Step an LR scheduler; one that takes a metric (`ReduceLROnPlateau`) gets the step's loss."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(loss)
    else:
        scheduler.step()


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
        plan_info: Mapping[str, Any] | None = None,
        init: InitFn | None = None,
        **options: Any,
    ) -> None:
        self._configure(
            model,
            dict(
                global_batch_size=global_batch_size,
                micro_batch_size=micro_batch_size,
                pipeline=pipeline,
                data=data,
                schedule=schedule,
                precision=precision,
                shared_weights=shared_weights,
                partition=partition,
                recompute=recompute,
                clip_grad_norm=clip_grad_norm,
                run_dir=run_dir,
                resume=resume,
                **options,
            ),
        )
        self.plan_info = dict(plan_info) if plan_info is not None else None  # engine.json's "plan"
        self.model = model
        meta = is_meta(model)  # built on the meta device: this rank makes only its stage real
        if meta and self.config.checkpoint.weights is None:
            require_init(model, init)
        micro = self._example_micro(example_batch)
        self.trace, traced = _stage.trace(model, micro)  # traced: output shapes, for skipped modules
        self._partition_and_schedule(micro, measure=not meta)
        self._check_memory(micro)  # before anything of the stage's size is allocated
        self._materialize(meta, traced, init)
        self._make_buckets()
        self._make_runtime(self._make_links(), traced)
        self._init_training_state()
        if self._resume_path is not None:
            self._resume()
        if self.rank == 0 and self.config.run_dir is not None:
            self._write_engine_info()
        self.observer: Observer = Telemetry.attach(self)  # says hello and ready
        self._runtime.observer = self.observer

    # construction, in the order __init__ runs it -----------------------------------------------
    def _configure(self, model: nn.Module, args: dict[str, Any]) -> None:
        """Join the job, check the options into `self.config`, and find this rank's place in it."""
        env = vdist.launch_env()
        self.rank, self.world_size = vdist.init_distributed()
        _log.setup(self.rank)
        pipeline, data = args.pop("pipeline"), args.pop("data")
        if pipeline == "auto":
            raise ConfigError(
                "pipeline='auto' is resolved by varuna.Varuna (from varuna import Varuna), which plans the "
                "shape and then builds this engine; varuna.engine.Varuna takes a pipeline depth"
            )
        if args["micro_batch_size"] is None:
            raise ConfigError(
                "micro_batch_size is required (or pass pipeline='auto' to let the planner choose it)"
            )
        pipeline = pipeline if pipeline is not None else (env.pipeline or 1)
        if data is None:
            data = env.data if env.data is not None else max(self.world_size // max(pipeline, 1), 1)
        partition, run_dir, resume = args.pop("partition"), args.pop("run_dir"), args.pop("resume")
        if args.get("notice_s") is None and os.environ.get("VARUNA_NOTICE_S", "").strip():
            args["notice_s"] = parse_duration(os.environ["VARUNA_NOTICE_S"], what="VARUNA_NOTICE_S")
        self.config = VarunaConfig(
            pipeline=pipeline,
            data=data,
            schedule=args.pop("schedule") or "1f1b",
            shared_weights=tuple(tuple(g) for g in (args.pop("shared_weights") or ())),
            partition=partition if isinstance(partition, str) else tuple(partition),
            run_dir=Path(run_dir) if run_dir is not None else env.run_dir,
            resume=resume if resume is not None else os.environ.get("VARUNA_RESUME") or None,
            **args,
        )
        cfg = self.config
        if cfg.checkpoint.checkpoint_every is not None and cfg.run_dir is None:
            raise ConfigError(
                f"checkpoint_every={cfg.checkpoint.checkpoint_every!r} needs a run directory to write "
                "checkpoints in: pass run_dir=... or launch with `varuna run`"
            )
        if cfg.engine.split_backward and any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()
        ):
            # torch.utils.checkpoint recomputes its region for every backward pass through it: a
            # split backward (input half, then weight half) would recompute each block twice more
            cfg.engine.split_backward = False
            log.info("varuna: the model uses gradient checkpointing: split_backward is off")
        P, D = cfg.engine.pipeline, cfg.engine.data
        if self.world_size != P * D:
            raise ConfigError(
                f"the job has {self.world_size} processes but pipeline x data = {P} x {D} = {P * D}; launch "
                f"with `varuna run --pipeline {P} --data {D} ...` ({P * D} processes), or pass pipeline/data "
                f"that multiply to {self.world_size}"
            )
        self.stage, self.replica = vdist.placement(self.rank, P)
        self.where = f"rank {self.rank} (stage {self.stage}, replica {self.replica})"
        self.device = _device()
        self.autocast = autocast_policy(cfg.engine.precision, self.device.type)
        self.scaler = LossScaler(cfg.engine.init_loss_scale) if cfg.engine.precision == "fp16" else None
        self._spec = spec = schedule_spec(cfg.engine.schedule)
        self.chunk_stages = spec.stages_of(self.stage, P)  # the virtual stages this rank holds
        self._rank_of: Callable[[int], int] = lambda s: spec.rank_of(s, P)
        self._resume_path = (
            ckpt.resolve(cfg.checkpoint.resume, cfg.run_dir) if cfg.checkpoint.resume is not None else None
        )

    def _example_micro(self, example_batch: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The micro-batch the trace runs (None: a single stage traces nothing)."""
        if self.config.engine.pipeline == 1 and example_batch is None:
            return None
        return self._example(example_batch)

    def _partition_and_schedule(self, micro: dict[str, Any] | None, *, measure: bool) -> None:
        """Cut the model into stages (`self.partition`) and lower the schedule for every rank."""
        cfg, spec, P = self.config, self._spec, self.config.engine.pipeline
        num_stages = P * spec.chunks_per_rank
        self.partition = _stage.partition(
            self.model,
            self.trace,
            micro,
            cfg,
            rank=self.rank,
            world_size=self.world_size,
            autocast=self.autocast,
            num_stages=num_stages,
            owners=[self._rank_of(v) for v in range(num_stages)],
            timed=spec.timed_order,
            measure=measure,
        )
        self.schedule = build_schedule(
            cfg.engine.schedule,
            P,
            cfg.engine.num_microbatches,
            recompute=cfg.engine.recompute,
            split_backward=cfg.engine.split_backward,
            costs=_stage.action_costs(self.partition, whole=cfg.engine.fuse_weights)
            if spec.timed_order
            else None,
        )
        self.actions: list[Action] = self.schedule[self.stage]

    def _check_memory(self, micro: dict[str, Any] | None) -> None:
        """Estimate this rank's memory and refuse a shape that cannot fit (`MemoryLimitError`)."""
        self.memory_estimate = rank_estimate(
            self.model,
            micro,
            self.trace,
            self.partition,
            self.config,
            self.schedule,
            chunk_stages=self.chunk_stages,
            rank_of=self._rank_of,
            device=self.device,
            autocast=self.autocast,
            where=self.where,
        )
        check_memory(self.memory_estimate, where=self.where, config=self.config)

    def _materialize(self, meta: bool, traced: dict[str, Any], init: InitFn | None) -> None:
        """Keep only this rank's stage, make it real on the device and give it its first values
        (seeded init, a weights file, or replica 0's, broadcast); a checkpoint's come later."""
        model, cfg = self.model, self.config
        owned = {n for v in self.chunk_stages for n in self.partition.stage_params[v]}
        _stage.strip(model, owned, self.device, traced)
        fresh = materialize(model, self.device, params=owned) if meta else {}
        _stage.to_device(model, self.device)
        self._params = _stage.owned_parameters(model)
        self._dp_group, self._tied_groups = _stage.make_groups(cfg, self.partition, self.stage, self._rank_of)
        _stage.initial_weights(model, fresh, cfg, self.trace.param_aliases, init=init)
        if self._resume_path is None and not meta and cfg.checkpoint.weights is None:
            # a checkpoint, a weights file or the seeded init give every replica the same values
            _stage.broadcast_initial_values(
                self._params, self.stage, self._dp_group, self._tied_groups, self._rank_of
            )

    def _make_buckets(self) -> None:
        """The data-parallel gradient buckets, and the tied weights this rank sums across stages."""
        tied_names = {n for g in self.partition.tied for n in g.names}
        by_name = dict(self._params)
        stage_of = {n: v for v in self.chunk_stages for n in self.partition.stage_params[v]}
        self._buckets = GradBuckets(
            [p for n, p in self._params if n not in tied_names],
            bucket_bytes=int(self.config.engine.bucket_mb * 2**20),
            stages={id(p): stage_of.get(n, self.stage) for n, p in self._params},
            dtype=torch.bfloat16 if self.config.engine.allreduce_dtype == "bf16" else None,
        )
        self._tied_local = [
            (g, pg, [by_name[n] for n in g.names if n in by_name])
            for g, pg, _ in self._tied_groups
            if set(self.chunk_stages) & set(g.stages)
        ]
        self._tied_first = [self._rank_of(g.stages[0]) == self.stage for g, _, _ in self._tied_local]

    def _make_links(self) -> list[Chunk]:
        """The links to the neighbouring stages, as this rank's chunks; the order refit beside them."""
        links, courier = _stage.pipeline_links(
            self.config,
            self.schedule,
            self.chunk_stages,
            self._rank_of,
            rank=self.rank,
            stage=self.stage,
            replica=self.replica,
            device=self.device,
        )
        self._courier = courier
        self._refit = OrderRefit.create(
            self.config,
            self._rank_of,
            stage=self.stage,
            chunk_stages=self.chunk_stages,
            courier=courier,
            device=self.device,
        )
        return [
            Chunk(v, self.partition.start_cut(v), self.partition.end_cut(v), up, down)
            for v, (up, down) in zip(self.chunk_stages, links)
        ]

    def _make_runtime(self, chunks: list[Chunk], traced: dict[str, Any]) -> None:
        """The runtime that runs this rank's actions on its chunks."""
        names = cut_names(self.model)
        position = {name: i for i, name in enumerate(self.trace.cut_names)}
        index_of = {mid: position.get(name, -1) for mid, name in names.items()}
        cfg = self.config
        self._runtime = StageRuntime(
            self.model,
            chunks=chunks,
            num_stages=cfg.engine.pipeline * self._spec.chunks_per_rank,
            cut_index=index_of,
            cut_names=self.trace.cut_names,
            device=self.device,
            autocast=self.autocast,
            recompute=cfg.engine.uses_recompute,
            opportunistic=self._spec.pull_ahead,
            where=self.where,
            traced=traced,
        )

    def _init_training_state(self) -> None:
        """The step counter, the optimizer's place, the history and the stop handling."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self.step_count = 0
        self.last_step_skipped = False
        self.nonfinite_steps = 0
        """Steps whose update was skipped for a NaN or Inf (`on_nonfinite="skip"`)."""
        self.last_grad_norm: float | None = None
        self.last_times: StepTimes | None = None
        self.history: list[dict[str, float]] = []
        self._loggers: list[tuple[MetricsLogger, int]] = []
        self.stop_request = StopRequest()
        self.stop_request.install(notice_s=self.config.engine.notice_s)
        self._notice = NoticeWatch(
            self.stop_request,
            run_dir=vdist.launch_env().run_dir,
            job=os.environ.get("VARUNA_JOB_ID") or None,
            rank=self.rank,
        )
        self._decision: Decision | None = None
        self.should_stop = False
        self._pending_optimizer: tuple[dict[str, torch.Tensor], list[dict[str, Any]], Any] | None = None
        self.resumed_from: Path | None = None
        self._morph_exit: Path | None = None
        self._saved_optimizer_class: str | None = None
        self.resume_info: dict[str, Any] | None = None
        self.last_checkpoint: dict[str, Any] | None = None
        self._pending_checkpoint: _train_state.PendingCheckpoint | None = None
        self._ckpt_group: Any = None
        self._last_checkpoint_time = time.monotonic()

    def _resume(self) -> None:
        """Load this stage's state from the checkpoint being resumed (the optimizer's waits for
        `set_optimizer`)."""
        assert self._resume_path is not None
        resumed = _train_state.resume(
            self._resume_path,
            self.config,
            rank=self.rank,
            world_size=self.world_size,
            param_shapes=self.trace.param_shapes,
            params=self._params,
            scaler=self.scaler,
        )
        self.step_count, self._pending_optimizer = resumed.step, resumed.pending_optimizer
        self._saved_optimizer_class = resumed.optimizer_class
        self.resumed_from, self.resume_info = self._resume_path, resumed.info

    def _example(self, example_batch: Mapping[str, Any] | None) -> dict[str, Any]:
        if example_batch is None:
            raise ConfigError(
                f"pipeline={self.config.engine.pipeline} needs example_batch=: one batch dict, as given to step(), so "
                "Varuna can run a forward pass to find the CutPoints and what each stage uses"
            )
        return slice_batch(example_batch, 0, self.config.engine.micro_batch_size)

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

    def request_stop(
        self,
        reason: str = "request_stop()",
        *,
        deadline: float | None = None,
        hosts: Sequence[str] | None = None,
    ) -> None:
        """Ask every rank to stop after the current step (the morph protocol; see varuna.elastic.protocol),
        or with `deadline` (epoch seconds: a preemption notice for `hosts`, None: all) after the
        last step that leaves time to checkpoint before it (`varuna.engine.notice`)."""
        self.stop_request.set(reason, deadline=deadline, hosts=None if hosts is None else list(hosts))

    def batch(
        self,
        dataset: Any,
        step: int,
        *,
        seed: int = 0,
        shuffle: bool | None = None,
        collate_fn: Any = None,
    ) -> dict[str, Any]:
        """This replica's share of step `step`'s global batch (the rules are in `varuna.data`).

        A map-style dataset is sampled by `sample_indices` (shuffled unless `shuffle=False`, by
        `seed`); an iterable one is read as one stream in its own order, through an iterator kept per
        dataset that moves on with the steps (an earlier step restarts it). `collate_fn` (a
        `varuna.data.CollateFn`: list of samples -> batch dict) replaces `varuna.data.collate`.
        """
        from varuna.data import Loaders

        loaders = getattr(self, "_data_loaders", None)
        if loaders is None:  # made on first use; only a stream's position is kept
            loaders = self._data_loaders = Loaders(
                global_batch_size=self.config.engine.global_batch_size,
                replica=self.replica,
                data_parallel=self.config.engine.data,
            )
        return loaders.get(dataset, seed=seed, shuffle=shuffle, collate_fn=collate_fn).batch(step)

    def batches(
        self,
        dataset: Any,
        start: int | None = None,
        stop: int | None = None,
        *,
        prefetch: int = 1,
        seed: int = 0,
        shuffle: bool | None = None,
        collate_fn: Any = None,
    ) -> Iterator[dict[str, Any]]:
        """This replica's batches of steps `start` (default: `step_count`, where a resume continues)
        up to `stop` (default: forever, or to a stream's end), read `prefetch` steps ahead by one
        background thread (0: none).

            for batch in engine.batches(dataset, stop=steps):
                engine.step(batch)

        The same batches as `batch(dataset, step)` for each step. The iterator has its own loader (a
        stream is skipped to `start` once); closing or dropping it stops the thread. An exception
        reading step k's batch is raised when the loop asks for step k's batch.
        """
        from varuna.data import open_loader, prefetched

        loader = open_loader(
            dataset,
            global_batch_size=self.config.engine.global_batch_size,
            replica=self.replica,
            data_parallel=self.config.engine.data,
            seed=seed,
            shuffle=shuffle,
            collate_fn=collate_fn,
        )
        return prefetched(loader, self.step_count if start is None else start, stop, depth=prefetch)

    def step(self, batch: Mapping[str, Any]) -> float:
        """Forward and backward over this replica's micro-batches, reduce, step; the global mean loss."""
        if self._morph_exit is not None:
            self._exit_to_morph()
        if self._pending_checkpoint is not None and self._pending_checkpoint.done():
            self.wait_checkpoint()  # a background write that failed raises here
        self._notice.begin_step()
        t0 = time.perf_counter()
        micro = self._micro_batches(batch)
        losses, times = self._run_pipeline(micro)
        loss, total_sq, stop, want_ckpt, timed_ckpt = self._agree(losses, times)
        self.should_stop = stop
        self._update(loss, total_sq, micro, times)
        self.step_count += 1
        if stop:
            self._announce_stop()
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
        if stop and self.config.elastic.on_stop == "exit":
            # Checkpoint now (a preempted VM has seconds), exit at the next step() so that the script
            # still sees this step's loss.
            self._morph_exit = self.checkpoint()
            self.observer.checkpoint_done(self.last_checkpoint, exit_code=MORPH_EXIT)
        self.observer.on_step(loss, times)
        if self._loggers:
            self._report_step(loss, times)
        if want_ckpt and self._morph_exit is None:
            self.checkpoint()
            self.observer.checkpoint_done(self.last_checkpoint)
        elif self._morph_exit is None and (timed_ckpt or self._checkpoint_due()):
            self.checkpoint(blocking=False)  # `checkpoint_every`: written while training goes on
            self._last_checkpoint_time = time.monotonic()
        self._notice.end_step()
        return loss

    def _checkpoint_due(self) -> bool:
        """Whether `checkpoint_every` (a number of steps) asks for a checkpoint after this step."""
        every = self.config.checkpoint.every_steps
        return every is not None and self.step_count % every == 0

    # one step, in the order step() runs it -------------------------------------------------------
    def _exit_to_morph(self) -> None:
        """The step after a stop request's checkpoint: exit with the morph status."""
        if self.rank == 0:
            reason = self.stop_request.reason or "by another rank"
            log.info(
                "varuna: stop requested (%s); checkpointed step %d to %s; exiting to morph",
                reason,
                self.step_count,
                self._morph_exit,
            )
        raise SystemExit(MORPH_EXIT)

    def _micro_batches(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """This replica's batch, checked, cut into the step's micro-batches on the device."""
        cfg = self.config.engine
        if not isinstance(batch, Mapping):
            raise ConfigError(
                f"step() takes one batch dict, as engine.batch(dataset, step) gives (got a {type(batch).__name__}); "
                "the engine splits it into micro-batches itself"
            )
        local = cfg.global_batch_size // cfg.data
        n = batch_len(batch)
        if n != local:
            raise ConfigError(
                f"step() got a batch of {n} samples but this replica's share of the global batch is "
                f"global_batch_size / data = {cfg.global_batch_size} / {cfg.data} = {local}; "
                "use engine.batch(dataset, step) or slice varuna.data.sample_indices(...)"
            )
        mbs = cfg.micro_batch_size
        return [slice_batch(batch, i * mbs, (i + 1) * mbs, self.device) for i in range(cfg.num_microbatches)]

    def _run_pipeline(self, micro: list[dict[str, Any]]) -> tuple[list[torch.Tensor], StepTimes]:
        """Run this rank's actions on the micro-batches (the data-parallel all-reduce starts at the
        schedule's ALLREDUCE) and wait for every reduction and send of the step."""
        self._buckets.zero_and_attach()
        for _, _, members in self._tied_local:
            for p in members:
                p.grad = None
        scale = self.scaler.scale if self.scaler is not None else 1.0
        self._works: list[Any] = []
        self._buckets.begin_step(self._dp_group, self.config.engine.data)
        overlap = self.config.engine.overlap_allreduce and self._courier is None
        if self._refit is not None and (refitted := self._refit.before_step(self.last_times, self.schedule)):
            self.schedule, self.actions = refitted, refitted[self.stage]
        losses, times = self._runtime.run(
            self.actions,
            micro,
            loss_coef=scale / len(micro),
            allreduce=self._start_allreduce,
            grads=self._buckets if overlap else None,
        )
        t_wait = time.perf_counter()
        for w in self._works:
            w.wait()
        self._finish_tied()
        self._runtime.finish()
        times.comm_s += time.perf_counter() - t_wait
        return losses, times

    def _agree(self, losses: list[torch.Tensor], times: StepTimes) -> tuple[float, float, bool, bool, bool]:
        """The step's one small all-reduce: every rank learns the global mean loss, the gradients'
        squared norm, whether any rank was asked to stop or (rank 0, by a controller) to
        checkpoint, and whether `checkpoint_every`'s seconds are up on rank 0's clock, so all act
        on the same step."""
        cfg = self.config.engine
        t0 = time.perf_counter()
        sumsq = self._local_sumsq()
        want_ckpt = self.observer.poll()  # rank 0's controller commands (stop sets stop_request)
        stop_now = self._stop_decision().stop
        every_s = self.config.checkpoint.every_s
        timed = (
            self.rank == 0
            and every_s is not None
            and time.monotonic() - self._last_checkpoint_time >= every_s
        )
        flags = torch.tensor(
            [
                float(sum(losses)) / cfg.num_microbatches if losses else 0.0,
                sumsq,
                float(stop_now),
                float(want_ckpt),
                float(timed),
            ],
            dtype=torch.float64,
            device=self.device,
        )
        if self.world_size > 1:
            dist.all_reduce(flags)
        times.comm_s += time.perf_counter() - t0
        loss, sq = float(flags[0]) / cfg.data, float(flags[1]) / cfg.data
        return loss, sq, bool(flags[2] > 0), bool(flags[3] > 0), bool(flags[4] > 0)

    def _stop_decision(self) -> Decision:
        """This rank's stop answer for the step's all-reduce: rank 0 reads the stop files first, each
        notice this rank holds is reported once, and a deadline is weighed (`varuna.engine.notice`)."""
        self._notice.poll()
        for notice in self._notice.new_notices():
            self.observer.on_notice(self._notice.describe(notice))
        pending = self._pending_checkpoint
        self._decision = self._notice.decide(writing=pending is not None and not pending.done())
        return self._decision

    def _announce_stop(self) -> None:
        """The ranks agreed to stop after this step: say so once, from rank 0 and from every rank
        that holds a request of its own (a SIGTERM reaches only one host's ranks)."""
        if self._notice.stop_announced or not (self.rank == 0 or self.stop_request):
            return
        self._notice.stop_announced = True
        d, deadline = self._decision, self.stop_request.deadline
        self.observer.on_stop(
            {
                "reason": self.stop_request.reason or "another rank",
                "deadline": deadline,
                "seconds_left": None if deadline is None else deadline - time.time(),
                "decided_here": bool(d is not None and d.stop),
                "step_s": d.step_s if d is not None else None,
                "checkpoint_s": d.checkpoint_s if d is not None else None,
                "needed_s": d.needed_s if d is not None else None,
            }
        )

    def _update(self, loss: float, total_sq: float, micro: list[dict[str, Any]], times: StepTimes) -> None:
        """Unscale and clip the gradients and step the optimizer and scheduler, unless the step
        overflowed (fp16: the scale shrinks) or went non-finite (`on_nonfinite`)."""
        cfg = self.config.engine
        scale = self.scaler.scale if self.scaler is not None else 1.0
        overflow = self.scaler is not None and not math.isfinite(total_sq)
        nonfinite = self.scaler is None and not (math.isfinite(loss) and math.isfinite(total_sq))
        if nonfinite and cfg.on_nonfinite == "raise":  # every rank agrees: the flags are reduced
            origin = _nonfinite.diagnose(self, micro)
            raise _nonfinite.NonFiniteError(_nonfinite.describe(self.step_count, loss, total_sq, origin))
        if nonfinite:
            self.nonfinite_steps += 1
            if self.rank == 0:
                _nonfinite.note_skip(self.step_count, loss, total_sq, self.where)
        self.last_step_skipped = overflow or nonfinite
        if nonfinite:
            self.last_grad_norm = None
            return
        if overflow:
            assert self.scaler is not None
            self.scaler.update(True)
            self.last_grad_norm = None
            return
        norm = math.sqrt(total_sq) / scale
        self.last_grad_norm = norm
        coef = 1.0 / scale
        if cfg.clip_grad_norm is not None and norm > cfg.clip_grad_norm:
            coef *= cfg.clip_grad_norm / (norm + 1e-6)
        grads = [p.grad for _, p in self._params if p.grad is not None]
        if coef != 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        if self.optimizer is not None:
            t_opt = time.perf_counter()
            self.optimizer.step()
            if self.lr_scheduler is not None:
                _step_scheduler(self.lr_scheduler, loss)
            times.compute_s += time.perf_counter() - t_opt
        if self.scaler is not None:
            self.scaler.update(False)

    def evaluate(self, data: Any, *, metrics: MetricsFn | None = None) -> Evaluation:
        """Collective: the model's mean loss (and summed `metrics`) over `data`, forwards only, on
        every rank; `varuna.engine.evaluate` says which samples each replica reads.

            result = engine.evaluate(val_set)          # result.loss, result.samples, result.metrics
        """
        result = _evaluate(self, data, metrics)
        self._report(
            {"eval/loss": result.loss, "eval/samples": result.samples}
            | {f"eval/{k}": v for k, v in result.metrics.items()},
            every_step=True,
        )
        return result

    # metrics -----------------------------------------------------------------------------------
    def add_logger(self, logger: Any, *, every: int = 1, all_ranks: bool = False) -> None:
        """Hand `logger` (`varuna.metrics.MetricsLogger`: TensorBoard, CSV, JSON lines, your own) the
        training figures after every `every`-th step and each evaluation's; on rank 0 only unless
        `all_ranks`. `close()` closes it.

            engine.add_logger(varuna.metrics.TensorBoardLogger("runs/gpt/tb"))
        """
        from varuna.metrics import check_logger

        check_int(every, "every")
        if all_ranks or self.rank == 0:
            self._loggers.append((check_logger(logger), every))

    def _report_step(self, loss: float, times: StepTimes) -> None:
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer is not None else None
        figures: dict[str, float] = {
            "train/loss": loss,
            "train/step_time_s": times.total_s,
            "train/samples_per_s": self.config.engine.global_batch_size / times.total_s
            if times.total_s
            else 0.0,
            "train/skipped": float(self.last_step_skipped),
        }
        if self.last_grad_norm is not None:
            figures["train/grad_norm"] = self.last_grad_norm
        if isinstance(lr, (int, float)):
            figures["train/lr"] = float(lr)
        self._report(figures)

    def _report(self, figures: Mapping[str, float], *, every_step: bool = False) -> None:
        for logger, every in self._loggers:
            if every_step or self.step_count % every == 0:
                logger.log_metrics(self.step_count, figures)

    def _eval_actions(self, num_microbatches: int) -> list[Action]:
        """This rank's forward-only actions for `num_microbatches`; serial links are replanned for
        them (`_eval_done` puts the training plan back)."""
        P = self.config.engine.pipeline
        lists = forward_only(self.config.engine.schedule, P, num_microbatches)
        if self._courier is not None:
            from varuna.comm.serial import plan

            self._courier.replan(plan(lists, self._rank_of, self.stage, self.rank))
        return lists[self.stage]

    def _eval_done(self) -> None:
        if self._courier is not None:
            from varuna.comm.serial import plan

            self._courier.replan(plan(self.schedule, self._rank_of, self.stage, self.rank))

    # checkpoints -------------------------------------------------------------------------------
    def checkpoint(self, root: str | Path | None = None, *, blocking: bool = True) -> Path:
        """Collective: save everything an exact resume needs, keyed by parameter name; returns the path.

        `blocking=False` copies this rank's state to host memory and writes it in a background
        thread while training goes on (`wait_checkpoint()` waits for it; its record then is
        `last_checkpoint`). At most one is in flight: a checkpoint asked for while one is being
        written waits for that one first. A write that fails raises its CheckpointError from the
        next `checkpoint`, `wait_checkpoint`, `step` or `close`; the previous checkpoint stays latest.
        """
        cfg = self.config
        self.wait_checkpoint()
        if root is None:
            if cfg.run_dir is None:
                raise CheckpointError(
                    "checkpoint() needs a run directory (run_dir=... or `varuna run`) or a root"
                )
            root = cfg.run_dir / "checkpoints"
        if not blocking and self._ckpt_group is None and self.world_size > 1:
            # the background write's collectives run on a group of their own (made collectively,
            # here, as checkpoint() is called by every rank at the same step)
            self._ckpt_group = dist.new_group(backend="gloo", timeout=vdist.group_timeout())
        path, saved = _train_state.save(
            Path(root),
            cfg,
            self.config_dict(),
            step=self.step_count,
            rank=self.rank,
            model=self.model,
            params=self._params,
            optimizer=self.optimizer,
            scaler=self.scaler,
            lr_scheduler=self.lr_scheduler,
            blocking=blocking,
            group=self._ckpt_group,
        )
        if isinstance(saved, _train_state.PendingCheckpoint):
            self._pending_checkpoint = saved
        else:
            self.last_checkpoint = saved
            self._notice.checkpoint_measured(saved["seconds"])
        return path

    def wait_checkpoint(self) -> dict[str, Any] | None:
        """Wait for the checkpoint being written in the background, if any; its record (also
        `last_checkpoint`), or None when none was in flight. Raises its CheckpointError if it failed."""
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is None:
            return None
        self.last_checkpoint = record = pending.wait()
        self._notice.checkpoint_measured(record["seconds"])
        self.observer.checkpoint_done(record)
        return record

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
        self._works += self._buckets.finish()  # the buckets not started during the last backward
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
                total.div_(self.config.engine.data)
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
        tensors += [t for first, t in zip(self._tied_first, self._tied_sums) if first]
        norms = torch._foreach_norm(tensors) if tensors else []
        return sum(float(n) ** 2 for n in norms)

    def close(self) -> None:
        """Release this engine's process groups (the default group stays for the next engine) and
        close its metrics loggers."""
        for logger, _ in self._loggers:
            logger.close()
        self._loggers = []
        self._runtime.close()  # its links destroy their groups
        if self._courier is not None:
            self._courier.close()
        self.wait_checkpoint()
        groups = [self._dp_group] if self._dp_group is not None else []
        groups += [self._ckpt_group] if self._ckpt_group is not None else []
        groups += [pg for _, pg, _ in self._tied_groups if pg is not None]
        for pg in groups:
            dist.destroy_process_group(pg)
        self._dp_group, self._tied_groups, self._ckpt_group = None, [], None

    @property
    def refit_info(self) -> dict[str, Any] | None:
        """Once the order was refitted to measured costs (`EngineConfig.refit_after`): on what, and
        the simulated step of the start-up order and the new one on them (`OrderRefit.info`)."""
        return self._refit.info if self._refit is not None else None

    # reporting ---------------------------------------------------------------------------------
    def describe(self) -> str:
        cfg = self.config
        planned = ""
        if self.plan_info is not None:
            from varuna.planner.auto import describe

            planned = "\n" + describe(self.plan_info)
        return (
            f"Varuna {cfg.engine.pipeline}x{cfg.engine.data} ({cfg.engine.schedule}, {cfg.engine.precision}, {cfg.engine.num_microbatches} micro-batches "
            f"of {cfg.engine.micro_batch_size}) — {self.where}{planned}\n{self.partition.describe()}"
        )

    def rank_of_stage(self, stage: int) -> int:
        """The global rank holding virtual stage `stage` in this rank's replica."""
        P = self.config.engine.pipeline
        return self.rank - self.stage + schedule_spec(self.config.engine.schedule).rank_of(stage, P)

    def config_dict(self) -> dict[str, Any]:
        return self.config.options()
