"""The straggler test's notebook, run on the first namespace host: start a job across hosts under a
JobController, wait until every rank is ready, then (from there, at most 60 s) for a straggler to be
flagged, exclude its host, wait for the job to finish.

    python straggler_driver.py RUN_DIR HOSTFILE INTERFACE STEPS PAUSE   -> one JSON line on stdout
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from varuna.controller import JobController

run_dir, hostfile, interface, steps, pause = sys.argv[1:6]
script = str(Path(__file__).with_name("straggler_train.py"))
ctl = JobController.start(
    [script, steps, pause],
    pipeline=1,
    data=2,
    run_dir=run_dir,
    hostfile=hostfile,
    interface=interface,
    grace_s=10.0,
)
out: dict = {}
try:
    # the clock for the flag starts once every rank is ready (start-up under load is not what is timed)
    launched = time.monotonic()
    out["start_state"] = ctl.wait(120, states=("running", "stopped", "failed", "finished"))
    out["start_s"] = round(time.monotonic() - launched, 1)
    start = time.monotonic()
    while (
        not (found := ctl.stragglers())
        and ctl.state not in ("stopped", "failed", "finished")
        and time.monotonic() < start + 60
    ):
        time.sleep(0.1)
    out["flagged"] = found
    out["flag_wait_s"] = round(time.monotonic() - start, 1)
    out["grid_hosts"] = {str(k): v for k, v in ctl.compute_grid().hosts.items()}
    if found:
        out["exclude_state"] = ctl.exclude_host(found[0]["host"])
    out["state"] = ctl.wait(90)
    out["stragglers_after"] = ctl.stragglers()
finally:
    if ctl.state not in ("stopped", "failed", "finished"):
        ctl.stop(checkpoint=False, timeout=20)
    ctl.close()
print(json.dumps(out, default=str))
