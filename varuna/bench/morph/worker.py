"""The training script of the morph benchmark: every rank runs it, rank 0 logs timestamped events.

    varuna run --elastic -p 2 -d 1 --run-dir RUN -m varuna.bench.morph.worker SPEC.json

SPEC.json (written by `varuna.bench.morph.job`) holds the model config, the batch shape and the step
counts. A fresh launch trains until a stop request morphs it (at most `max_steps`); a resumed
launch trains `steps_after` more steps and ends. Rank 0 appends one JSON line per event to
RUN/bench-events.jsonl, each with `t` (time.time()), the launch number and the shape:

    process_start   when the OS started this process (from /proc: before Python and torch load)
    module_start    when this module was imported (after varuna.launch.worker imported torch and met
                    the other ranks)
    imported        varuna.engine.engine, .data and .models imported (torch.distributed.checkpoint with them)
    model_built     the GPT constructed (and initialised) on this rank
    engine_built    `Varuna(...)` returned; `resume_info` is the engine's own load record, and
                    `phases` the resume's seconds in varuna.checkpoint.layout's I/O calls
    optimizer_set   AdamW built (the first one imports torch._dynamo) and `set_optimizer` returned
                    (it installs the resumed optimizer state)
    step            a step returned: `start`, `step_s` (the engine's own step time), `loss`
    checkpoint      the stop request's checkpoint (`engine.last_checkpoint`), right after its step,
                    with `phases`: rank 0's seconds in varuna.checkpoint.layout's I/O calls (see `_Probe`)
    early_checkpoint  with `early_checkpoint_step` in the spec: an ordinary engine.checkpoint() then
    exit            `engine.step()` raised SystemExit (75: checkpointed, ready to morph)
    done            the resumed launch finished its steps
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_MODULE_START = time.time()  # the imports above are varuna.launch.worker's too: already loaded, ~free

EVENTS = "bench-events.jsonl"
LR = 1e-4


def process_start_time() -> float | None:
    """Wall time at which this process was started, from /proc (10 ms resolution); None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in ticks since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - started)


class _Events:
    """Appends events as JSON lines (rank 0 only; the other ranks' calls do nothing)."""

    def __init__(self, path: Path, active: bool, **common: Any) -> None:
        self.path, self.active, self.common = path, active, common

    def __call__(self, event: str, t: float | None = None, **fields: Any) -> None:
        if not self.active:
            return
        record = {"event": event, "t": time.time() if t is None else t, **self.common, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


class _Delegate:
    """A module stand-in: the given attributes replaced, every other one the module's own."""

    def __init__(self, module: Any, **replaced: Any) -> None:
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _Probe:
    """Wall seconds this process spends in the calls `varuna.checkpoint.layout` makes, by kind.

    The bench times the library from outside without editing it: `install` rebinds names in
    `varuna.checkpoint.storage` (`checksum`) and `varuna.checkpoint.layout` (its `dcp` and `dist` modules
    through a `_Delegate`), and wraps `os.fsync` process-wide (so the checksums and fsyncs inside
    `dcp.save` and `dcp.load` count too: `crc32` and `fsync` overlap them). A name the module no
    longer has is skipped, so a refactor loses detail, not the run.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def _wrap(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - t0

        return timed

    def install(self) -> None:
        from varuna.checkpoint import layout as vck
        from varuna.checkpoint import storage as cio

        if hasattr(cio, "checksum"):  # every CRC-32 computation, the in-memory ones inside dcp.save/load too
            cio.checksum = self._wrap("crc32", cio.checksum)  # type: ignore[method-assign]
        if hasattr(vck, "dcp"):
            vck.dcp = _Delegate(  # type: ignore[assignment]
                vck.dcp, save=self._wrap("dcp.save", vck.dcp.save), load=self._wrap("dcp.load", vck.dcp.load)
            )
        if hasattr(vck, "dist"):
            names = ("barrier", "all_gather_object", "broadcast_object_list")
            wrapped = {n: self._wrap("collectives", getattr(vck.dist, n)) for n in names}
            vck.dist = _Delegate(vck.dist, **wrapped)  # type: ignore[assignment]
        os.fsync = self._wrap("fsync", os.fsync)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {}
        return {k: round(v, 4) for k, v in out.items()}


def main(argv: list[str]) -> None:
    import torch  # already imported by varuna.launch.worker; varuna.engine.engine brings torch.distributed.checkpoint
    import torch.distributed as dist

    from varuna import Varuna
    from varuna.data import SyntheticLM, collate
    from varuna.models import GPT, GPTConfig

    imported = time.time()
    probe = _Probe()
    probe.install()
    spec = json.loads(Path(argv[0]).read_text())
    faulthandler.dump_traceback_later(spec["hang_s"], exit=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    run_dir = Path(os.environ["VARUNA_RUN_DIR"])
    shape = f"{os.environ.get('VARUNA_PIPELINE', '1')}x{os.environ.get('VARUNA_DATA', '1')}"
    events = _Events(
        run_dir / EVENTS, rank == 0, launch=int(os.environ.get("VARUNA_LAUNCH", "1")), shape=shape
    )
    events("process_start", t=process_start_time(), pid=os.getpid())
    events("module_start", t=_MODULE_START)
    events("imported", t=imported)

    cfg = spec["model"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    events("model_built")
    dataset = SyntheticLM(cfg["vocab_size"], cfg["seq_len"], 4096, seed=0)
    example = collate([dataset[i] for i in range(spec["micro_batch_size"])])
    engine = Varuna(
        model,
        global_batch_size=spec["global_batch_size"],
        micro_batch_size=spec["micro_batch_size"],
        example_batch=example,
    )
    events("engine_built", step=engine.step_count, resume_info=engine.resume_info, phases=probe.take())
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR))
    events("optimizer_set")

    resumed = engine.resume_info is not None
    end = engine.step_count + spec["steps_after"] if resumed else spec["max_steps"]
    try:
        for step in range(engine.step_count, end):
            batch = engine.batch(dataset, step)
            probe.take()  # what the step's checkpoint spends, nothing earlier
            start = time.time()
            try:
                loss = engine.step(batch)
            except SystemExit as exc:
                events("exit", code=exc.code, step=engine.step_count)
                raise
            events(
                "step",
                step=step,
                start=start,
                step_s=engine.history[-1]["time_s"],
                loss=loss,
                resumed=resumed,
            )
            last = engine.last_checkpoint
            if last is not None and last["step"] == engine.step_count:
                events("checkpoint", **last, phases=probe.take())
            elif not resumed and step == spec.get("early_checkpoint_step"):
                engine.checkpoint()  # as periodic checkpointing would: the morph's is not the first
                events("early_checkpoint", **(engine.last_checkpoint or {}), phases=probe.take())
        events("done", step=engine.step_count)
    finally:
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1:])
