"""The straggler test's training script: controller_train.py's tiny GPT on a larger batch, one host's rank on a small core.

    JobController.start([this, STEPS, PAUSE], ...)   with STRAGGLER_CGROUP="h2=NAME" in the environment

The rank on the named host starts at full speed; once its engine has said `hello` it waits until the
test has moved it into the CPU cgroup NAME (the test's model of that host's one small core, where busy
loops run too), then it trains STEPS steps (resuming
from VARUNA_RESUME after a morph) and spins PAUSE seconds after each, so the test can act while the
job runs. A spin, not a sleep: a rank that sleeps most of the time wakes with the scheduler's credit
and runs its short steps ahead of the hog, while a busy rank (as a real training rank is) gets its
fair share of the core.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from transparency_common import build, dataset, optimizer  # noqa: E402

from varuna import Varuna  # noqa: E402
from varuna.data import collate  # noqa: E402


def wait_for_small_core() -> None:
    """On the slow host, wait until the test has moved this process into its CPU cgroup."""
    host, _, group = os.environ.get("STRAGGLER_CGROUP", "").partition("=")
    if not group or socket.gethostname() != host:
        return
    deadline = time.monotonic() + 30.0
    while f"/{group}\n" not in Path("/proc/self/cgroup").read_text():
        if time.monotonic() > deadline:
            raise SystemExit(f"not moved into the CPU cgroup {group} within 30 s of saying hello")
        time.sleep(0.05)


steps, pause = int(sys.argv[1]), float(sys.argv[2])
# A step needs more CPU than the small core's quota gives in one period (25 ms per 100 ms): with
# shorter steps (32 samples, about 10 ms) a step sometimes ran whole at the start of a fresh period,
# at full speed, and the three slow steps in a row the watch flags came a step or two late
GLOBAL_BATCH, MICRO_BATCH = 128, 8
data = dataset("gpt")
engine = Varuna(
    build("gpt"),
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=MICRO_BATCH,
    partition="uniform",
    example_batch=collate([data[i] for i in range(MICRO_BATCH)]),
)
engine.set_optimizer(optimizer(engine.parameters()))
wait_for_small_core()  # after `hello`: start-up (importing torch, the rendezvous) runs at full speed
for step in range(engine.step_count, steps):
    engine.step(engine.batch(data, step))
    end = time.perf_counter() + pause
    while time.perf_counter() < end:
        pass
