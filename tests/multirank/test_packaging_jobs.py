"""What a user's install does, in fresh processes: `import varuna` pulls in no notebook stack,
`varuna --version` imports no torch, a torchrun job trains without mpi4py, a rank that mpiexec starts
without mpi4py names the extra, and `pip install <repo>` into a new venv gives a working `varuna`.

The commands are the ones docs/install.md shows (checked here too).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from _helpers import REPO, SCRIPTS

pytestmark = [pytest.mark.multirank, pytest.mark.foreground]
ROOT = REPO
TORCHRUN = ["torchrun", "--standalone", "--nproc-per-node", "2"]
"""How docs/install.md starts a one-host job with torchrun (before the script and its arguments)."""


def _run(cmd: list[str], *, timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    """`cmd` to the end in a session of its own; past `timeout` its process group gets SIGTERM, then
    SIGKILL, so no rank outlives the test, and subprocess.TimeoutExpired is raised."""
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kw,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _env(**extra: str) -> dict[str, str]:
    """This environment without PYTHONPATH (a fresh venv must import its own varuna), one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def test_import_varuna_pulls_in_no_notebook_stack() -> None:

    code = "import sys, varuna; bad = [m for m in ('plotly', 'ipywidgets', 'IPython', 'jupyter_client') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_varuna_version_prints_both_versions_without_importing_torch(tmp_path: Path) -> None:
    out = _run(
        [str(Path(sys.executable).parent / "varuna"), "--version"], timeout=60, cwd=tmp_path, env=_env()
    )
    assert out.returncode == 0, out.stderr
    want = f"varuna {importlib.metadata.version('varuna')} (torch {importlib.metadata.version('torch')})\n"
    assert out.stdout == want
    code = (
        "import sys\nfrom varuna.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, 'mpi4py' in sys.modules)"
    )
    out = _run([sys.executable, "-c", code], timeout=60, cwd=tmp_path, env=_env())
    assert out.stdout.splitlines()[-1] == "False False", out.stdout + out.stderr


def test_a_rank_mpiexec_starts_without_mpi4py_names_the_extra(tmp_path: Path) -> None:
    """PMI_RANK and PMI_SIZE are what mpiexec (hydra) gives each rank; mpi4py is made unimportable."""
    code = "import sys\nsys.modules['mpi4py'] = None\nfrom varuna.comm.rendezvous import init_distributed\ninit_distributed()"
    out = _run([sys.executable, "-c", code], timeout=120, cwd=tmp_path, env=_env(PMI_RANK="0", PMI_SIZE="2"))
    assert out.returncode == 1
    assert "varuna.errors.LaunchError: mpi4py is not installed in this environment" in out.stderr
    assert 'pip install "varuna[mpi]"' in out.stderr


# --- torchrun: one launch, several checks -----------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`torchrun --standalone --nproc-per-node 2 tests/scripts/torchrun_train.py OUT`, run once."""
    where = tmp_path_factory.mktemp("torchrun")
    out = where / "records"
    bin_dir = Path(sys.executable).parent
    cmd = [str(bin_dir / TORCHRUN[0]), *TORCHRUN[1:], str(SCRIPTS / "torchrun_train.py"), str(out)]
    # the ranks import varuna as installed, from the job's own directory
    return _run(cmd, timeout=240, cwd=where, env=_env()), out


def _records(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
class TestTorchrun:
    def test_both_ranks_finish_as_the_two_stages(self, torchrun_job) -> None:
        done, out = torchrun_job
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        records = _records(out)
        assert [(r["rank"], r["world"], r["stage"]) for r in records] == [(0, 2, 0), (1, 2, 1)]

    def test_losses_agree_across_ranks_and_with_plain_training(self, torchrun_job) -> None:
        _, out = torchrun_job
        first, second = _records(out)
        assert len(first["losses"]) == 2 and first["losses"] == second["losses"]
        torch.testing.assert_close(
            torch.tensor(first["losses"]), torch.tensor(first["plain"]), rtol=1e-5, atol=0
        )

    def test_no_rank_needed_mpi4py(self, torchrun_job) -> None:
        _, out = torchrun_job
        assert [r["mpi4py_loaded"] for r in _records(out)] == [False, False]

    def test_install_docs_show_this_command(self) -> None:
        text = (ROOT / "docs" / "install.md").read_text()
        assert " ".join(TORCHRUN) + " train.py" in text


# --- pip install into a fresh venv -------------------------------------------------------------------


def _source_tree(dst: Path) -> Path:
    """The repository's files as a clone with the working tree's changes would hold them (tracked and
    untracked, not ignored), so pip's in-tree build writes its build/ and egg-info there, not here."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():  # a tracked file deleted in the working tree is not there to copy
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    return dst


@pytest.mark.timeout(1200)
def test_pip_install_into_a_fresh_venv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m venv`, `pip install torch==2.13.0`, `pip install <repo>` (build isolation: setuptools
    comes from PyPI), then `import varuna` and `varuna --version` from that venv, outside the repo."""
    venv, src = tmp_path / "venv", _source_tree(tmp_path / "varuna-src")
    py = venv / "bin" / "python"
    times: dict[str, float] = {}
    steps = [
        ("venv", [sys.executable, "-m", "venv", str(venv)], 180),
        ("torch", [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"], 600),
        ("varuna", [str(py), "-m", "pip", "install", "-q", str(src)], 300),
    ]
    for name, cmd, limit in steps:
        started = time.monotonic()
        done = _run(cmd, timeout=limit, cwd=tmp_path, env=_env())
        times[name] = round(time.monotonic() - started, 1)
        assert done.returncode == 0, f"{' '.join(cmd)}:\n{(done.stdout + done.stderr)[-4000:]}"
    with capsys.disabled():
        print(f"\nfresh venv install times (s): {times}")

    code = (
        "import importlib.util, varuna\nprint(varuna.__version__)\nprint(varuna.__file__)\n"
        "print(importlib.util.find_spec('mpi4py') is None)"
    )
    done = _run([str(py), "-c", code], timeout=120, cwd=tmp_path, env=_env())
    assert done.returncode == 0, done.stderr
    version, where, no_mpi4py = done.stdout.split()
    assert version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert Path(where).is_relative_to(venv) and no_mpi4py == "True"  # mpi4py is the `mpi` extra

    done = _run([str(venv / "bin" / "varuna"), "--version"], timeout=60, cwd=tmp_path, env=_env())
    assert done.returncode == 0 and re.fullmatch(
        rf"varuna {version} \(torch 2\.13\.0(\+\w+)?\)\n", done.stdout
    ), done
    package = Path(where).parent
    assert (package / "py.typed").is_file()
    licence = next(package.parent.glob(f"varuna-{version}.dist-info")) / "licenses" / "LICENSE"
    assert licence.read_text() == (ROOT / "LICENSE").read_text()

    # without the `mpi` extra, `varuna run` says what to install before it starts anything
    (tmp_path / "train.py").write_text("")
    cmd = [str(venv / "bin" / "varuna"), "run", "--pipeline", "2", "--run-dir", "run", "train.py"]
    done = _run(cmd, timeout=60, cwd=tmp_path, env=_env())
    assert done.returncode == 2 and 'pip install "varuna[mpi]"' in done.stderr, done.stderr
