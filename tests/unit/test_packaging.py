"""The install paths agree: environment.yml lists what pyproject.toml and the Makefile install."""

from __future__ import annotations

import re
import tomllib

from _helpers import REPO as ROOT


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
    wanted = {_name(s) for s in project["dependencies"] + extras["dev"] + extras["notebook"] + widgets} - {
        "varuna"
    }
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
