"""Launch test helper: rank 1 fails (``raise``, ``kill``) or hangs (``hang``) while the others wait in a barrier.

varuna run --pipeline 2 tests/scripts/launch_fail.py raise MARKER
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch.distributed as dist


def main() -> None:
    mode = sys.argv[1]
    if dist.get_rank() == 1 and mode != "hang":
        time.sleep(0.3)
        print(f"rank 1 about to {mode} at {time.time():.3f}", flush=True)  # the test times the end from here
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        err = ValueError("boom")
        err.add_note("note: raised on purpose by launch_fail.py")
        raise err
    dist.barrier()  # with raise/kill this never completes: rank 1 is gone
    print(f"rank {dist.get_rank()} hanging", flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
