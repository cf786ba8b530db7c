"""The one-process rendezvous of a plain `python script.py`, in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from _helpers import REPO

pytestmark = pytest.mark.multirank


@pytest.mark.timeout(120)
def test_init_distributed_single_process_without_mpi() -> None:
    """A plain `python script.py` gets a world of one on loopback and never loads MPI."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import torch.distributed as dist
        import varuna.comm.rendezvous as vd
        assert "mpi4py" not in sys.modules, "importing varuna.comm.rendezvous loaded mpi4py"
        assert vd.init_distributed(timeout_s=30) == (0, 1)
        assert vd.init_distributed() == (0, 1)  # idempotent
        assert dist.get_backend() == "gloo"
        t = torch.ones(3)
        dist.all_reduce(t)
        assert "mpi4py" not in sys.modules, "the one-process path loaded mpi4py"
        vd.shutdown()
        vd.shutdown()
        assert not dist.is_initialized()
        print("ok", t.tolist())
        """
    )
    marker_vars = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK")
    env = {k: v for k, v in os.environ.items() if k not in marker_vars}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok [1.0, 1.0, 1.0]"
