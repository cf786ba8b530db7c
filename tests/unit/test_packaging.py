"""The install paths agree (environment.yml lists what pyproject.toml and the Makefile install), and
the distribution's metadata says what users expect: one version, the licence, py.typed, the extras."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from _helpers import REPO as ROOT

from varuna.errors import LaunchError


def _name(spec: str) -> str:
    return re.split(r"[<>=!~\[ ;]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _env_pip() -> list[str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    specs = []
    for line in lines[start + 1 :]:
        m = re.match(r"^\s+- (.+)$", line)
        if not m:
            break
        specs.append(m.group(1).strip())
    return specs


def test_environment_yml_matches_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    widgets = tomllib.loads((ROOT / "widgets" / "pyproject.toml").read_text())["project"]["dependencies"]
    every = project["dependencies"] + extras["mpi"] + extras["dev"] + extras["notebook"] + widgets
    wanted = {_name(s) for s in every} - {"varuna"}
    listed = {_name(s) for s in _env_pip() if not s.startswith("-e")}
    assert wanted - listed == set(), f"environment.yml lacks {sorted(wanted - listed)}"
    extra = listed - wanted - {"mpich"}  # the MPI wheel is chosen by the installer, as in the Makefile
    assert extra == set(), f"environment.yml lists {sorted(extra)} that pyproject.toml does not"


def test_torch_pin_and_mpi_wheel_agree_with_the_makefile() -> None:
    make = (ROOT / "Makefile").read_text()
    torch_pin = re.search(r"^TORCH_SPEC \?= (.+)$", make, re.M).group(1).strip()
    mpi = re.search(r"^MPI_WHEEL \?= (.+)$", make, re.M).group(1).strip()
    assert torch_pin in _env_pip()
    assert mpi in _env_pip()


# --- one version, the licence, the typed marker, the extras ---------------------------------------


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_comes_from_pyproject_through_the_installed_metadata() -> None:
    import varuna

    assert varuna.__version__ == importlib.metadata.version("varuna") == _pyproject()["project"]["version"]
    init = (ROOT / "varuna" / "__init__.py").read_text()
    assert not re.search(r"^__version__\s*=", init, re.M), "a second version source in varuna/__init__.py"


def test_varuna_version_prints_varuna_and_torch(capsys: pytest.CaptureFixture[str]) -> None:
    from varuna.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    torch_version = importlib.metadata.version("torch")
    assert (
        capsys.readouterr().out == f"varuna {importlib.metadata.version('varuna')} (torch {torch_version})\n"
    )


def test_license_file_is_the_apache_2_text_the_metadata_declares() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and "http://www.apache.org/licenses/LICENSE-2.0" in text


def test_py_typed_ships_in_the_package() -> None:
    assert (ROOT / "varuna" / "py.typed").is_file()
    assert (
        "py.typed"
        in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
            "varuna"
        ]
    )


def test_lowest_torch_declared_is_the_one_the_makefile_tests() -> None:
    make = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^TORCH_SPEC \?= torch==(\d+)\.(\d+)\.\d+$", make, re.M)
    declared = [s for s in _pyproject()["project"]["dependencies"] if _name(s) == "torch"]
    assert pinned and declared == [f"torch>={pinned.group(1)}.{pinned.group(2)}"]


def test_mpi_is_an_extra_with_mpi4py_and_the_makefile_wheel() -> None:
    project = _pyproject()["project"]
    assert "mpi4py" not in {_name(s) for s in project["dependencies"]}
    make = (ROOT / "Makefile").read_text()
    mpi = re.search(r"^MPI_WHEEL \?= (.+)$", make, re.M).group(1).strip()
    assert {_name(s) for s in project["optional-dependencies"]["mpi"]} == {"mpi4py", mpi}


def test_changelog_has_unreleased_and_0_1_0() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    heads = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert heads[:2] == ["Unreleased", "0.1.0"], heads


# --- without mpi4py (an install without the `mpi` extra) --------------------------------------------


def test_a_rank_without_mpi4py_is_told_to_install_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from varuna.comm.rendezvous import check_mpi4py

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `import mpi4py` fails, as when not installed
    with pytest.raises(
        LaunchError, match=r'mpi4py is not installed .*`pip install "varuna\[mpi\]"`.*torchrun'
    ):
        check_mpi4py()


def test_varuna_run_without_mpi4py_refuses_before_mpiexec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from varuna.launch.job import Job

    for name in ("SLURM_JOB_ID", "VARUNA_LAUNCHER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    script = tmp_path / "train.py"
    script.write_text("")
    job = Job([str(script)], pipeline=2, data=1, run_dir=tmp_path / "run")
    with pytest.raises(LaunchError, match=r'pip install "varuna\[mpi\]"'):
        job.start()
    assert job.state == "before" and not (tmp_path / "run" / "job.json").exists()
