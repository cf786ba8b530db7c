"""The fixed per-step cost of a pipeline step outside its schedule, on a model small enough for it to show.

    varuna run --pipeline 2 --run-dir /tmp/ovh varuna/bench/pipeline/step_overhead.py [STEPS] [MICROBATCHES]

Trains `gpt_tiny` at P = 2 with micro-batches of one sample, so each step is many small messages and
little compute, and prints one `OVERHEAD {json}` line per rank with the medians over the timed steps of:

- `step_s`: the engine's step, from `step()` called to returned;
- `actions_s`: the sum of the schedule's actions (`StepTimes.spans`: every F, B, send and receive);
- `outside_s`: `step_s - actions_s`, the fixed cost of a step outside its schedule (posting the step's
  receives, waiting for the sends, the step's all-reduce, the optimizer);
- `p2p_s`: the sends and receives among the actions (`SEND_F`, `RECV_F`, `SEND_B`, `RECV_B`), where a
  message's own overhead is paid (with the waits for late messages);
- `send_s`: the sends alone (`SEND_F`, `SEND_B`), which never wait: the cost of putting messages out;
- `cpu_s`: the rank's CPU time per step (all its threads, gloo's included), which a loaded host
  disturbs less than wall time.

It measures and reports, never asserts (timings on a shared host drift).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from varuna import Varuna
from varuna.data import SyntheticLM, collate
from varuna.models import GPT, gpt_tiny

P2P_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    micro = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    warmup = 5
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 4096, seed=7)
    engine = Varuna(
        GPT(cfg),
        pipeline=2,
        data=1,
        global_batch_size=micro,
        micro_batch_size=1,
        schedule="1f1b",
        example_batch=collate([data[0]]),
    )
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.01))
    rows: list[tuple[float, float, float, float, float]] = []
    for k in range(warmup + steps):
        batch = engine.batch(data, k)
        c0 = time.process_time()
        engine.step(batch)
        cpu = time.process_time() - c0
        times = engine.last_times
        assert times is not None
        actions = sum(s.end - s.start for s in times.spans)
        p2p = sum(s.end - s.start for s in times.spans if s.kind in P2P_KINDS)
        send = sum(s.end - s.start for s in times.spans if s.kind in ("SEND_F", "SEND_B"))
        if k >= warmup:
            rows.append((times.total_s, actions, p2p, send, cpu))
    step_s = statistics.median(r[0] for r in rows)
    report = {
        "stage": engine.stage,
        "microbatches": micro,
        "steps": steps,
        "step_s": step_s,
        "actions_s": statistics.median(r[1] for r in rows),
        "outside_s": statistics.median(r[0] - r[1] for r in rows),
        "p2p_s": statistics.median(r[2] for r in rows),
        "send_s": statistics.median(r[3] for r in rows),
        "cpu_s": statistics.median(r[4] for r in rows),
    }
    print("OVERHEAD " + json.dumps(report), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
