"""The documentation stays true to the code: the generated configuration page is current, every
Python block in docs/ is either run by a test or marked illustrative, the changelog page includes
CHANGELOG.md, and the README's links resolve. `make docs` builds the site itself (`mkdocs build
--strict`: broken links and missing API references fail there)."""

from __future__ import annotations

import copy
import datetime
import importlib.util
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLE = re.compile(r"^<!-- docs example[^>]*-->$")
ILLUSTRATIVE = "<!-- illustrative -->"


def _load(name: str) -> ModuleType:
    """A script under docs/ (`gen_config`, `hooks/plots`) as a module."""
    spec = importlib.util.spec_from_file_location(f"docs_{name.replace('/', '_')}", DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_generated_from_the_code() -> None:
    wanted = _load("gen_config").render()
    have = (DOCS / "configuration.md").read_text()
    assert have == wanted, (
        "docs/configuration.md is stale (an option, its docstring or a VARUNA_* variable changed): "
        "run `python docs/gen_config.py > docs/configuration.md`"
    )


def test_the_configuration_page_lists_every_option_and_variable() -> None:
    from varuna.engine.config import OPTIONS

    page = (DOCS / "configuration.md").read_text()
    for name in OPTIONS:
        assert f"| `{name}` |" in page, f"option {name} missing from docs/configuration.md"
    source = "\n".join(p.read_text() for p in (ROOT / "varuna").rglob("*.py"))
    for name in set(re.findall(r"[\"'](VARUNA_[A-Z0-9_]*[A-Z0-9])[\"']", source)):
        assert f"| `{name}` |" in page, f"{name} missing from docs/configuration.md"


def test_an_undocumented_environment_variable_stops_the_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = _load("gen_config")
    monkeypatch.delitem(gen.ENV_MEANINGS, "VARUNA_THREADS")
    with pytest.raises(SystemExit, match=r"without a meaning in ENV_MEANINGS .*VARUNA_THREADS"):
        gen.render()


def test_the_cli_reference_is_generated_from_the_parser() -> None:
    wanted = _load("gen_cli").render()
    have = (DOCS / "cli-reference.md").read_text()
    assert have == wanted, (
        "docs/cli-reference.md is stale (a varuna subcommand, option, default or help text changed): "
        "run `python docs/gen_cli.py > docs/cli-reference.md`"
    )


def test_the_cli_reference_has_every_subcommand_and_option() -> None:
    import argparse

    from varuna.cli import build_parser

    page = (DOCS / "cli-reference.md").read_text()
    sections = dict(re.findall(r"^## varuna (\S+)\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sections) == set(commands.choices), "docs/cli-reference.md: subcommands differ from the parser"
    for name, sub in commands.choices.items():
        for action in sub._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in sections[name], f"varuna {name} {option} missing from its section"
    assert "(cli-reference.md)" in (DOCS / "cli.md").read_text(), "docs/cli.md should link the reference"


# --- the benchmark pages' figures (docs/hooks/plots.py) ---------------------------------------------

RESULTS = DOCS / "benchmarks" / "results"
PLOT_LINE = re.compile(r"^\s*<!--\s*plot\b")


def _plots() -> ModuleType:
    return _load("hooks/plots")


def _numbers(value: object) -> Iterator[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield float(value)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*")), ids=lambda p: p.name)
def test_every_result_file_has_what_its_plots_need(path: Path) -> None:
    plots = _plots()
    result = plots.load(path)  # the name, bench, date, page, source and SCHEMAS[bench]'s fields
    datetime.date.fromisoformat(result.date)
    assert (DOCS / result.page).is_file(), f"{path.name}: page {result.page} is not under docs/"
    assert len(result.source.split()) >= 5, f"{path.name}: source should say which page, run and date"
    assert any(p.bench == result.bench for p in plots.PLOTS.values()), f"{path.name}: no plot draws it"


def test_the_newest_result_of_each_bench_holds_only_numbers_its_page_gives() -> None:
    """A transcription check: every number of the newest file of a bench appears on its page (as
    written there, `1,330` or `-5%`); older files keep history the page may have moved past."""
    plots = _plots()
    newest: dict[str, object] = {}
    for path in sorted(RESULTS.glob("*.json")):
        result = plots.load(path)
        newest[result.bench] = result
    assert newest, "no result files in docs/benchmarks/results"
    for result in newest.values():
        page = (DOCS / result.page).read_text()
        stated = {abs(float(n.replace(",", ""))) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", page)}
        invented = sorted({n for n in _numbers(result.data) if abs(n) not in stated})
        assert not invented, f"{result.path.name}: {invented} appear nowhere on docs/{result.page}"


def test_a_result_file_the_plots_cannot_read_is_refused_with_the_field(tmp_path: Path) -> None:
    plots = _plots()
    data = json.loads((RESULTS / "2026-12-05-pipeline.json").read_text())

    def refused(name: str, changed: dict, match: str) -> None:
        (tmp_path / name).write_text(json.dumps(changed))
        with pytest.raises(plots.ResultsError, match=match):
            plots.load(tmp_path / name)

    missing = copy.deepcopy(data)
    del missing["runs"][1]["pairs"]
    refused("2026-12-05-pipeline.json", missing, r"runs\[1\] lacks the field 'pairs'")
    text = copy.deepcopy(data)
    text["runs"][0]["pairs"]["ZB-V"] = "1.074"
    refused("2026-12-05-pipeline.json", text, r"runs\[0\]\.pairs\.ZB-V should be int or float, got '1.074'")
    refused("2026-12-06-pipeline.json", data, r"date is '2026-12-05' but the file name says '2026-12-06'")
    refused("pipeline.json", data, r"named <YYYY-MM-DD>-<bench>\.json")
    refused("2026-12-05-pipeline.json", {**data, "source": " "}, r"source should say")


def test_every_plot_marker_names_a_plot_and_every_plot_is_shown() -> None:
    plots = _plots()
    shown = set()
    for page in _pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if PLOT_LINE.match(line):
                where = f"{page.relative_to(ROOT)}:{number}"
                marker = plots.MARKER.match(line)
                assert marker, f"{where}: a plot marker is a line of its own, `<!-- plot: NAME -->`"
                assert marker["name"] in plots.PLOTS, (
                    f"{where}: no plot {marker['name']!r} in docs/hooks/plots.py"
                )
                shown.add(marker["name"])
    assert shown == set(plots.PLOTS), f"plots no page shows: {sorted(set(plots.PLOTS) - shown)}"
    with pytest.raises(plots.ResultsError, match=r"<!-- plot: nope --> names no plot"):
        plots.figure_markdown("nope", "benchmarks/pipeline.md")
    figure = plots.figure_markdown("pipeline-ratios", "benchmarks/pipeline.md")
    assert "](img/pipeline-ratios.svg)" in figure
    assert "[2026-12-05-pipeline.json](results/2026-12-05-pipeline.json)" in figure


@pytest.mark.parametrize(
    "name", ["pipeline-ratios", "memory-growth", "planner-accuracy", "planner-scale", "network-throughput"]
)
def test_each_plot_draws_an_svg_from_the_result_files(name: str) -> None:
    pytest.importorskip("matplotlib")
    plots = _plots()
    svg = plots.render(name)
    root = ET.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert len(svg) < 200_000, f"{name}: {len(svg)} bytes of SVG"


def _python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, the non-blank line before it) of each ```python fence opening outside other fences."""
    found, fence, before = [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = stripped[: len(stripped) - len(stripped.lstrip("`"))]
            if stripped[len(fence) :].strip().split(" ")[0] in ("python", "py"):
                found.append((number, before))
        elif fence is not None and stripped == fence:
            fence = None
        if stripped and fence is None and not stripped.startswith("```"):
            before = stripped
    return found


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_every_python_block_is_run_by_a_test_or_marked_illustrative(page: Path) -> None:
    unmarked = [
        number
        for number, before in _python_blocks(page.read_text())
        if not (EXAMPLE.match(before) or before == ILLUSTRATIVE)
    ]
    assert not unmarked, (
        f"{page.relative_to(ROOT)}: the Python blocks at lines {unmarked} need a marker on the line before: "
        f"`<!-- docs example N: HOW -->` when a test runs the block, else `{ILLUSTRATIVE}`"
    )


def test_the_marker_check_sees_blocks_and_their_markers() -> None:
    text = "\n".join(
        [
            ILLUSTRATIVE,
            "```python",
            "x = 1",
            "```",
            "```markdown",
            "```python",  # inside another fence: not a block of its own
            "```",
            "",
            "<!-- docs example 2: python -->",
            "```python",
            "```",
            "text",
            "```python",
            "```",
        ]
    )
    assert _python_blocks(text) == [
        (2, ILLUSTRATIVE),
        (10, "<!-- docs example 2: python -->"),
        (13, "text"),
    ]


def test_the_transformers_example_keeps_the_marker_its_test_reads() -> None:
    text = (DOCS / "transformers.md").read_text()
    assert "<!-- docs example: tests/multirank/test_transformers.py runs this block as a 2x2 job -->" in text


def test_the_changelog_page_includes_the_root_changelog() -> None:
    assert '--8<-- "CHANGELOG.md"' in (DOCS / "changelog.md").read_text().splitlines()


def test_the_readme_links_resolve_and_it_stays_a_front_door() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250, "the README is a front door; details go into docs/"
    assert "make test" in text and "make lab" in text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if re.match(r"^[a-z]+://", target):
            continue
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_doctests_in_docstrings_become_code_blocks_on_the_api_pages() -> None:
    pytest.importorskip("griffe")
    fence = _load("griffe_doctests").fence_doctests
    text = "Summary.\n\n>>> [str(a) for a in x]\n['0F0', '0F1']\n\nMore text."
    assert fence(text) == "Summary.\n\n```pycon\n>>> [str(a) for a in x]\n['0F0', '0F1']\n```\n\nMore text."
    assert fence("Run:\n>>> f()\n1") == "Run:\n\n```pycon\n>>> f()\n1\n```"
    code = "Diagram:\n\n    >>> already(code)\n    1"
    assert fence(code) == code
