"""Trains the transparency models at the job's P x D and saves, per rank, what it learnt and where it ran.

Run as `varuna run --hostfile H --pipeline P --data D tests/scripts/multihost_worker.py OUT SCHEDULE,...`
on namespace hosts (tests/multihost): the test compares the losses and parameters with plain training
and reads the host name, address, network stack and gloo interface of every rank from `OUT/<kind>-<schedule>/rank{r}.pt`.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import BUCKET_MB, GLOBAL_BATCH, MICRO_BATCH, MODELS, STEPS, build, dataset, optimizer  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.comm.addresses import interface_addresses, network_stack  # noqa: E402
from varuna.comm.rendezvous import launch_env  # noqa: E402
from varuna.data import collate  # noqa: E402

out, schedules = Path(sys.argv[1]), sys.argv[2].split(",")
env = launch_env()
P, D = env.pipeline or 1, env.data or 1

for kind in MODELS:
    for schedule in schedules:
        data = dataset(kind)
        engine = Varuna(
            build(kind),
            pipeline=P,
            data=D,
            global_batch_size=GLOBAL_BATCH,
            micro_batch_size=MICRO_BATCH,
            example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
            schedule=schedule,
            bucket_mb=BUCKET_MB,
        )
        engine.set_optimizer(optimizer(engine.parameters()))
        losses = [engine.step(engine.batch(data, k)) for k in range(STEPS)]
        tag = out / f"{kind}-{schedule}"
        tag.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "losses": losses,
                "params": {n: p.detach().clone() for n, p in engine.named_parameters()},
                "stage": engine.stage,
                "replica": engine.rank // P,
                "host": socket.gethostname(),
                "stack": network_stack(),
                "address": interface_addresses().get("eth0"),
                "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                "buckets": len(engine._buckets.buffers),
                "started_early": engine._buckets.started_early,  # before the ALLREDUCE action
            },
            tag / f"rank{engine.rank}.pt",
        )
        engine.close()
print("multihost worker done", flush=True)
