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

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


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
