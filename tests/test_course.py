"""The course's shape: its notebooks, where they are listed, their checks collapsed, their references to one
another pointing at notebooks that exist (nbval runs the notebooks themselves)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAMES = [path.stem for path in NOTEBOOKS]
#: A notebook named in text: `05-prefetch-and-overlap`, `a1-your-own-training-loop`.
REFERENCE = re.compile(r"`((?:\d\d|a\d)-[a-z0-9-]+)`")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def test_the_course_is_nineteen_notebooks_in_order_and_an_appendix():
    main = [name for name in NAMES if name[:2].isdigit()]
    appendix = [name for name in NAMES if name.startswith("a")]
    assert [int(name[:2]) for name in main] == list(range(19)), main
    assert appendix == [
        "a1-your-own-training-loop",
        "a2-changing-settings-mid-run",
        "a3-fine-tuning-a-pretrained-model",
        "a4-lora-fine-tuning",
        "a5-out-of-memory-lab",
    ]
    assert len(NAMES) >= 24


def test_every_notebook_is_listed_in_the_course_page_the_site_and_the_readme():
    course, site, readme = ((ROOT / name).read_text() for name in ("docs/course.md", "mkdocs.yml", "README.md"))
    for name in NAMES:
        assert f"(notebooks/{name}.ipynb)" in course, name
        assert f"notebooks/{name}.ipynb" in site, name
        assert f"`{name}`" in readme, name
    assert course.index("a1-your-own-training-loop") > course.index("## Appendix")


def test_each_notebooks_checks_are_collapsed_so_the_text_reads_first():
    for path in NOTEBOOKS:
        checks = [c for c in _cells(path) if c["cell_type"] == "code" and _source(c).startswith("# The claims above")]
        assert checks, f"{path.name} has no checks"
        for cell in checks:
            assert cell["metadata"].get("jupyter", {}).get("source_hidden") is True, (path.name, _source(cell)[:60])


def test_notebooks_name_only_notebooks_that_exist():
    for path in NOTEBOOKS:
        named = {match for cell in _cells(path) for match in REFERENCE.findall(_source(cell))}
        assert named <= set(NAMES), (path.name, named - set(NAMES))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _names_in_history(name: str) -> set[str]:
    """Every name the notebook had: ``git log --follow`` through renames, down to a 30% match (merges)."""
    log = _git("log", "--follow", "-M30%", "--name-only", "--format=", "--", f"notebooks/{name}.ipynb")
    return {Path(line).stem for line in log.split()}


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the repository's history")
def test_the_course_page_says_what_ran_on_a_gpu_for_every_notebook_keyed_by_content():
    """docs/course.md's GPU record: a row per notebook; a notebook that ran on a GPU names the file it was at the
    recorded run's commit, one of its own earlier names (a number now worn by other content is not it); a
    notebook that never ran had no earlier name in the course at that commit."""
    course = (ROOT / "docs/course.md").read_text()
    record = course.split("## What has run on a GPU", 1)[1]
    commit = re.search(r"run 2, `([0-9a-f]{7,})`", record).group(1)
    assert "GPU run 2" in _git("log", "-1", "--format=%s", commit)
    then = {Path(path).stem for path in _git("ls-tree", "--name-only", commit, "notebooks/").split()}
    table = [line.split("|") for line in record.splitlines() if line.startswith("| `")]
    rows = {cells[1].strip().strip("`"): cells for cells in table}
    assert sorted(rows) == NAMES, sorted(set(NAMES) ^ set(rows))
    for name, row in rows.items():
        earlier = _names_in_history(name) & then
        ran_as = set(REFERENCE.findall(row[2]))
        if row[2].strip() == "never":
            assert not earlier, (name, earlier)
        else:
            assert earlier and earlier <= ran_as <= then, (name, ran_as, earlier)
            for merged in ran_as - earlier:  # deleted by a commit that made this notebook: merged into it
                deleted = _git("log", "--diff-filter=D", "--format=%h", "--", f"notebooks/{merged}.ipynb").split()
                made = _git("log", "--follow", "--format=%h", "--", f"notebooks/{name}.ipynb").split()
                assert set(deleted) & set(made), (name, merged)
    assert "12-composing-compile-and-tp" not in then  # today's 12 is not the 12 that ran


def _notebook(path: Path, metadata: dict) -> None:
    cell = {"cell_type": "code", "execution_count": None, "id": "c0", "metadata": {}, "outputs": [], "source": "1"}
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook = {"cells": [cell], "metadata": {"kernelspec": kernelspec, **metadata}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(notebook))


def test_a_notebook_that_needs_a_newer_torch_or_a_missing_library_is_skipped_with_the_reason(tmp_path):
    """notebooks/conftest.py, as the floor run meets it: nbval reports the notebook's cells skipped, saying what
    it needs, and starts no kernel for it (the notebook's one cell would run otherwise)."""
    import torch

    (tmp_path / "conftest.py").write_text((ROOT / "notebooks" / "conftest.py").read_text())
    _notebook(tmp_path / "newer.ipynb", {"nbfsdp": {"min_torch": "99.0"}})
    _notebook(tmp_path / "library.ipynb", {"nbfsdp": {"needs": ["no_such_library_nbfsdp"]}})
    _notebook(tmp_path / "runs_here.ipynb", {"nbfsdp": {"min_torch": torch.__version__.split("+")[0]}})
    # a pytest of its own: not the suite's options (its JUnit file, its plugins from the repository's root)
    env = {name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"}
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval-lax", "-p", "no:cacheprovider", "-rs", "newer.ipynb",
         "library.ipynb"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:]
    assert "2 skipped" in ran.stdout and "passed" not in ran.stdout, ran.stdout[-2000:]
    assert f"newer.ipynb: needs torch >= 99.0 (this is {torch.__version__.split('+')[0]})" in ran.stdout
    assert "library.ipynb: needs no_such_library_nbfsdp (pip install no_such_library_nbfsdp)" in ran.stdout
    spec = importlib.util.spec_from_file_location("course_conftest", ROOT / "notebooks" / "conftest.py")
    rule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rule)  # the same rule, for a notebook that runs on this torch
    assert rule.why_skipped(json.loads((tmp_path / "runs_here.ipynb").read_text())["metadata"]["nbfsdp"]) is None


def test_what_a_notebook_needs_is_said_in_its_first_cell_and_on_the_course_page():
    """A notebook's ``nbfsdp`` metadata (what the floor run skips it for) is the reader's too: its first cell
    names the torch it runs on or the library it needs, and the course page's floor table has its row."""
    course = (ROOT / "docs/course.md").read_text().split("## On which torch", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip() for line in course.splitlines()
            if line.startswith("| `")}  # fmt: skip
    assert sorted(rows) == NAMES, sorted(set(NAMES) ^ set(rows))
    for path in NOTEBOOKS:
        needs = json.loads(path.read_text())["metadata"].get("nbfsdp", {})
        first = _source(_cells(path)[0])
        if "min_torch" in needs:
            assert f"*Runs on torch {needs['min_torch']}" in first and needs["why"] in first, path.name
            assert rows[path.stem] == f"skipped: needs torch {needs['min_torch']}", path.name
        elif needs.get("needs"):
            assert all(f"*Needs `{name}`" in first for name in needs["needs"]), path.name
            assert rows[path.stem] == f"skipped: needs {', '.join(needs['needs'])}", path.name
        else:
            assert "*Runs on torch" not in first and rows[path.stem] == "passed", path.name
