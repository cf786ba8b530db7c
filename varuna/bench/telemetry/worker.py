"""One job of the telemetry benchmark: every rank runs this module, rank 0 writes the per-step figures.

    JobController.start(["-m", "varuna.bench.telemetry.worker", SPEC.json], pipeline=P, data=D)

The job trains a GPT with its telemetry attached to a live controller and switches it every step,
the same on every rank: warm-up steps on, then pairs of adjacent steps, (off, on), (on, off),
(off, on), ... so that each pair's two steps run a fraction of a second apart (the host's load,
which drifts over seconds, is nearly the same for both) and the order alternates (a steady drift
cancels over two pairs). A step is timed from a barrier that lines the ranks up
to the end of `engine.step`, which includes the telemetry's own work (spans, metrics, memory, the
log write and the ZeroMQ send); its time is the slowest rank's, its CPU seconds each rank's.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from varuna.bench.common import LR, build_model, gather, global_batches
from varuna.telemetry.recorder import Telemetry


def phases(warmup: int, pairs: int) -> list[str]:
    """The phase of every step: `warmup` steps "on", then `pairs` pairs, (off, on) and (on, off) in turn.

    >>> phases(1, 3)
    ['warmup', 'off', 'on', 'on', 'off', 'off', 'on']
    """
    out = ["warmup"] * warmup
    for k in range(pairs):
        out += ["off", "on"] if k % 2 == 0 else ["on", "off"]
    return out


def main(argv: list[str]) -> None:
    from varuna import Varuna

    spec = json.loads(Path(argv[0]).read_text())
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(spec["hang_s"], exit=True)
    plan = phases(spec["warmup"], spec["pairs"])
    spec = {**spec, "steps": len(plan) - spec["warmup"]}
    batches = global_batches({**spec, "steps": min(spec["steps"], 8)})  # cycled: data making is not timed
    engine = Varuna(
        build_model(spec["model"]),
        global_batch_size=spec["global_batch_size"],
        micro_batch_size=spec["micro_batch_size"],
        schedule=spec["schedule"],
        example_batch=batches[0],
    )
    engine.set_optimizer(torch.optim.AdamW(engine.parameters(), lr=LR))
    # The bench's own switch; a controller does the same with `set(paused=...)`, but a command lands
    # on whichever step each rank polls next, and this must be the same step on every rank.
    telemetry = engine.observer
    assert isinstance(telemetry, Telemetry)  # the engine's observer
    wall: list[float] = []
    cpu: list[float] = []
    memory: list[bool] = []
    for i, phase in enumerate(plan):
        telemetry.paused = phase == "off"
        batch = batches[i % len(batches)]
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        engine.step(batch)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        memory.append(telemetry.last_step_counted_memory)
    mine = {"wall": wall, "cpu": cpu, "memory": memory, "drops": telemetry.drops}
    every = gather(mine)
    if engine.rank == 0:
        steps = [
            {
                "phase": phase,
                "wall_s": round(max(r["wall"][i] for r in every), 6),
                "cpu_s": [round(r["cpu"][i], 6) for r in every],
                "memory_counted": any(r["memory"][i] for r in every),
            }
            for i, phase in enumerate(plan)
        ]
        result: dict[str, Any] = {
            "steps": steps,
            "telemetry_enabled": telemetry.enabled,
            "memory_every": telemetry.memory_every,
            "spans_every": telemetry.spans_every,
            "min_interval_s": telemetry.min_interval_s,
            "drops": [r["drops"] for r in every],
            "boundaries": list(engine.partition.boundaries),
            "num_microbatches": engine.config.num_microbatches,
        }
        out = Path(spec["out"])
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)
    engine.close()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1:])
