"""The order in which ``make test``'s workers take the test files: the longest first.

pytest-xdist's ``--dist loadfile`` hands each worker a whole file at a time, in the order the files were
collected (``--no-loadscope-reorder``; by default xdist orders them by their number of tests, which says
nothing of their time). Files taken longest first leave the shortest for the end, so both workers finish
together: replaying a quiet run's per-file times through xdist's scheduler, its default order ended with one
worker idle for 97 s while the other ran the last files (the Binder and browser tests, one test each but 75 and
36 s, went last); longest first, 0 s. ``durations.json`` holds each file's seconds in a quiet fresh-clone run;
a file not in it counts as the median file. Refresh it from a run's JUnit XML after files grow or move:
``python -m tests.scheduling JUNIT.xml``.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


def longest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files by their recorded seconds, longest first. The sort is stable, so a
    file's own tests, and files of equal seconds, keep the order they were collected in."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    unknown = statistics.median(seconds.values()) if seconds else 0.0
    items.sort(key=lambda item: -seconds.get(_file_of(item.nodeid), unknown))


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def seconds_per_file(junit_xml: Path) -> dict[str, float]:
    """Each test file's seconds in a JUnit XML report (pytest's ``--junitxml``), as paths from the root."""
    totals: Counter[str] = Counter()
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        path = case.get("file") or _path_from_classname(case.get("classname", ""))
        totals[path] += float(case.get("time", 0))
    return {path: round(total, 1) for path, total in totals.most_common()}


def _path_from_classname(classname: str) -> str:
    """``tests.test_bench`` -> ``tests/test_bench.py``; nbval's ``notebooks.00-quickstart.ipynb`` as it is."""
    if classname.endswith(".ipynb"):
        directory, _, name = classname.partition(".")
        return f"{directory}/{name}"
    return classname.replace(".", "/") + ".py"


if __name__ == "__main__":
    DURATIONS.write_text(json.dumps(seconds_per_file(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {DURATIONS}")
