"""Every magic, flag and public function has an entry in the documentation's sources (docs/).

The lists come from the code itself (the magics' argparse parsers, ``nbfsdp.__all__``), so a flag
or a function added without a line in docs/ fails here. The site's build (``mkdocs build
--strict`` in ``make test``) catches broken links and API references.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import pytest

import nbfsdp
from nbfsdp.kernel import flags
from nbfsdp.kernel.magics import FSDPMagics
from tests.test_layout import ALLOWED

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def _docs_text() -> str:
    """All Markdown under docs/ (the notebooks are rendered as they are and not counted)."""
    return "\n".join(p.read_text() for p in sorted(DOCS.rglob("*.md")) if "course" not in p.parts)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """The parsers IPython's magic_arguments attached to each magic (``%%fsdp?`` prints them)."""
    return {
        "%%fsdp": FSDPMagics.fsdp.parser,
        "%fsdp": FSDPMagics.fsdp_line.parser,
        "%fsdp explain": flags.explain_arguments.parser,
        "%fsdp save": flags.save_arguments.parser,
        "%fsdp load": flags.load_arguments.parser,
        "%fsdp checkpoints": flags.checkpoints_arguments.parser,
        "%fsdp export": flags.export_arguments.parser,
        "%fsdp attach": flags.attach_arguments.parser,
    }


def _flags() -> set[str]:
    return {
        option
        for parser in _parsers().values()
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }


def _actions() -> set[str]:
    (action,) = [a for a in _parsers()["%fsdp"]._actions if a.dest == "action"]
    return set(action.choices)


def test_the_parsers_are_found() -> None:
    """Guards the tests below against passing on an empty list."""
    assert {"--world-size", "--timeout", "--async", "--sharding-strategy", "--code"} <= _flags()
    assert {"status", "stop", "explain", "set"} <= _actions()


@pytest.mark.parametrize("flag", sorted(_flags()))
def test_every_flag_is_documented(flag: str) -> None:
    # A flag's entry is its name in code quotes, alone or with its argument (`--min-params N`).
    assert re.search(rf"`{re.escape(flag)}(\s[^`]*)?`", _docs_text()), f"{flag} has no entry in docs/"


@pytest.mark.parametrize("action", sorted(_actions()))
def test_every_line_magic_action_is_documented(action: str) -> None:
    assert re.search(rf"`%fsdp {re.escape(action)}\b", _docs_text()), f"%fsdp {action} has no entry in docs/"


def test_the_cell_magic_is_documented() -> None:
    assert "`%%fsdp" in _docs_text()


@pytest.mark.parametrize("name", sorted(nbfsdp.__all__))
def test_every_public_name_is_in_the_api_reference(name: str) -> None:
    api = (DOCS / "api.md").read_text()
    assert re.search(rf"^::: nbfsdp\.(\w+\.)*{re.escape(name)}$", api, re.M), f"nbfsdp.{name} is not in docs/api.md"


def test_a_flag_without_docs_fails() -> None:
    """The check itself: a flag nobody wrote about is not found."""
    assert not re.search(r"`--no-such-flag(\s[^`]*)?`", _docs_text())


@pytest.mark.parametrize("name", sorted(nbfsdp.__all__))
def test_every_public_name_is_in_the_readme(name: str) -> None:
    assert f"`nbfsdp.{name}" in (REPO / "README.md").read_text(), f"nbfsdp.{name} is not in the README's API line"


def _nav_pages() -> list[str]:
    """The pages of mkdocs.yml's nav, read as text (its Python tags keep a YAML loader from reading it safely)."""
    nav = (REPO / "mkdocs.yml").read_text().partition("\nnav:\n")[2]
    return re.findall(r":\s+(\S+\.(?:md|ipynb))\s*$", nav, re.M)


def test_the_nav_is_read() -> None:
    assert {"index.md", "guide/cell.md", "api.md", "notebooks/00-quickstart.ipynb"} <= set(_nav_pages())


@pytest.mark.parametrize("page", [page for page in _nav_pages() if page != "index.md"])
def test_every_page_of_the_nav_is_linked_from_the_home_page(page: str) -> None:
    """The home page links each page; a notebook through the course's overview, which links each one."""
    linked_from = "course.md" if page.startswith("notebooks/") else "index.md"
    assert f"]({page})" in (DOCS / linked_from).read_text(), f"docs/{linked_from} does not link {page}"


def _may_import(subpackage: str) -> set[str]:
    """What a subpackage's docstring says it may import of nbfsdp, besides itself: the names in code quotes
    in its sentence that starts "May import", up to that sentence's first colon, semicolon or full stop
    (``nbfsdp`` alone: the package root)."""
    docstring = (REPO / "nbfsdp" / subpackage / "__init__.py").read_text()
    sentence = re.search(r"May import\s(.*?)(?:[:;]|\.\s|\.$)", docstring, re.S)
    assert sentence, f"nbfsdp/{subpackage}/__init__.py says nothing starting 'May import'"
    return {name.removeprefix("nbfsdp.") or "nbfsdp" for name in re.findall(r"``(nbfsdp(?:\.\w+)?)``", sentence[1])}


@pytest.mark.parametrize("subpackage", sorted(ALLOWED))
def test_each_subpackage_says_what_test_layout_allows_it(subpackage: str) -> None:
    assert _may_import(subpackage) == ALLOWED[subpackage] - {subpackage}
