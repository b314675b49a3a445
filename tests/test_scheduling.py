"""The order ``make test``'s workers take the files in: longest first, each file's tests in their own order."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests import scheduling


@dataclass
class Item:
    nodeid: str


def test_files_go_longest_first_and_keep_their_own_order(tmp_path, monkeypatch):
    durations = tmp_path / "durations.json"
    recorded = {"tests/test_long.py": 300, "notebooks/a.ipynb": 120, "tests/test_gone.py": 50, "tests/test_short.py": 2}
    durations.write_text(json.dumps(recorded))
    monkeypatch.setattr(scheduling, "DURATIONS", durations)
    collected = [
        "tests/test_short.py::test_a", "tests/test_long.py::test_b", "tests/test_new.py::test_c",
        "tests/test_long.py::test_a", "notebooks/a.ipynb::Cell 0", "tests/test_short.py::test_b",
        "notebooks/a.ipynb::Cell 1",
    ]  # fmt: skip
    items = [Item(nodeid) for nodeid in collected]
    scheduling.longest_files_first(items)
    assert [item.nodeid for item in items] == [
        "tests/test_long.py::test_b", "tests/test_long.py::test_a",
        "notebooks/a.ipynb::Cell 0", "notebooks/a.ipynb::Cell 1",
        "tests/test_new.py::test_c",  # not recorded: the median file's, 85 s
        "tests/test_short.py::test_a", "tests/test_short.py::test_b",
    ]  # fmt: skip


def test_a_junit_report_gives_each_files_seconds(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_bench" name="test_a" time="400.5"/>'
        '<testcase classname="tests.test_bench" name="test_b" time="12.5"/>'
        '<testcase classname="notebooks.00-quickstart.ipynb" name="Cell 2" time="25.0"/>'
        '<testcase classname="tests.test_docs" name="test_c" time="0.25"/>'
        "</testsuite></testsuites>"
    )
    assert scheduling.seconds_per_file(report) == {
        "tests/test_bench.py": 413.0, "notebooks/00-quickstart.ipynb": 25.0, "tests/test_docs.py": 0.2,
    }  # fmt: skip


def test_the_recorded_durations_name_files_that_exist():
    recorded = json.loads(scheduling.DURATIONS.read_text())
    root = scheduling.DURATIONS.parent.parent
    assert len(recorded) > 50 and all((root / path).exists() for path in recorded), [
        path for path in recorded if not (root / path).exists()
    ]
