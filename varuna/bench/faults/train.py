"""The fault bench's training script: a tiny GPT, STEPS steps, PAUSE seconds after each.

    varuna run -p 2 varuna/bench/faults/train.py STEPS PAUSE [--crash-at N] [--stop-first] [--store-report FILE]

--crash-at N: a launch that started at step 0 checkpoints after step N-1 and raises in step N (a
relaunch from that checkpoint goes through). --stop-first: rank 0 sends itself SIGUSR1 before Varuna()
exists. --store-report FILE: rank 0 writes where the rendezvous store listens (from /proc/net/tcp*).
Resuming (VARUNA_RESUME), checkpoints, stops and morphs all come through the engine.
"""

from __future__ import annotations

import sys
from pathlib import Path

# run as a script, this folder comes first on sys.path; its modules must not shadow others
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from varuna.comm.addresses import listening_on  # noqa: E402


def store_report(path: Path) -> None:
    import torch.distributed as dist

    store: Any = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):  # PrefixStore -> TCPStore
        store = store.underlying_store
    port = int(store.port)
    path.write_text(json.dumps({"port": port, "listen": listening_on(port)}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("pause", type=float)
    parser.add_argument("--crash-at", type=int)
    parser.add_argument("--stop-first", action="store_true")
    parser.add_argument("--store-report", type=Path)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from varuna import Varuna
    from varuna.data import SyntheticLM, collate
    from varuna.models import GPT, gpt_tiny

    rank = dist.get_rank() if dist.is_initialized() else 0
    if args.stop_first and rank == 0:
        os.kill(os.getpid(), signal.SIGUSR1)  # before Varuna() exists: the worker keeps the request
    torch.manual_seed(0)
    cfg = gpt_tiny()
    data = SyntheticLM(cfg.vocab_size, cfg.seq_len, 256, seed=7)
    engine = Varuna(
        GPT(cfg),
        global_batch_size=4,
        micro_batch_size=2,
        partition="uniform",
        example_batch=collate([data[0], data[1]]),
    )
    engine.set_optimizer(torch.optim.SGD(engine.parameters(), lr=0.1))
    if args.store_report is not None and engine.rank == 0:
        store_report(args.store_report)
    first = engine.step_count
    for step in range(first, args.steps):
        if args.crash_at == step and first == 0:
            raise RuntimeError(f"crashed on purpose in step {step} (the fault bench's --crash-at)")
        loss = engine.step(engine.batch(data, step))
        if engine.rank == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
        if args.crash_at is not None and step + 1 == args.crash_at and first == 0:
            engine.checkpoint()
        time.sleep(args.pause)


if __name__ == "__main__":
    main()
