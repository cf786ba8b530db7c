"""The documentation stays true to the code: the generated configuration page is current, every
Python block in docs/ is either run by a test or marked illustrative, the changelog page includes
CHANGELOG.md, and the README's links resolve. `make docs` builds the site itself (`mkdocs build
--strict`: broken links and missing API references fail there)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXAMPLE = re.compile(r"^<!-- docs example[^>]*-->$")
ILLUSTRATIVE = "<!-- illustrative -->"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_{name}", DOCS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
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
