"""``make test-gpu``: every GPU test and every course notebook with its ranks on GPUs, and one summary line.

Where a CUDA GPU is visible it runs, side by side, ``pytest -m gpu tests`` (one process: the tests share a
shell and its cluster) and ``pytest --nbval-lax notebooks`` (spread over worker processes, a notebook to a
worker, where pytest-xdist is installed), both with ``NBFSDP_DEVICE=cuda``: every cell that names no device
puts its ranks on the GPUs, several to a GPU where there are fewer GPUs than ranks. Without a GPU, or
without torch, it says so in one line and exits 0 (CI has no GPU).

The GPU machines this project is lent have torch but not the notebook stack: CONTRIBUTING says which wheels
to bring. Logs and JUnit reports land in ``test-artifacts/gpu/``; the last line printed is the summary.

    python -m tests.gpu_suite [--workers N]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts" / "gpu"
#: What the suite is sized for on one H100 or H200 (issue 35): a run past it says so in its summary.
BUDGET_SECONDS = 8 * 60


@dataclass
class Outcome:
    """One pytest run, read from its JUnit report."""

    passed: int = 0
    failed: list[str] = field(default_factory=list)
    skipped: int = 0
    files_failed: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)
    returncode: int = 0


def where() -> tuple[str | None, str | None]:
    """The GPUs in words, or why there are none to test on."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed here"
    if not torch.cuda.is_available():
        return None, "no CUDA GPU is visible here"
    count = torch.cuda.device_count()
    return f"{count} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", None


def gpu_test_files() -> list[str]:
    """The test modules with tests marked ``gpu`` (collecting only those: the others may import what a GPU
    machine lacks, a browser driver for one)."""
    marked = re.compile(r"^from tests\.conftest import .*\bgpu\b", re.MULTILINE)
    return [
        str(path.relative_to(REPO)) for path in sorted(REPO.glob("tests/test_*.py")) if marked.search(path.read_text())
    ]


def _xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True


def _start(name: str, arguments: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
    report = ARTIFACTS / f"{name}.xml"
    log = open(ARTIFACTS / f"{name}.log", "w")  # noqa: SIM115 (the process writes it; closed with the run)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", "-rfE", *arguments]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), report


def _read(report: Path, returncode: int) -> Outcome:
    outcome = Outcome(returncode=returncode)
    if not report.exists():
        outcome.failed.append(f"no report ({report.name}): pytest exited with {returncode}")
        return outcome
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        file = case.get("file") or case.get("classname", "")
        outcome.files.add(file)
        if case.find("skipped") is not None:
            outcome.skipped += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome.failed.append(f"{case.get('classname')}::{case.get('name')}")
            outcome.files_failed.add(file)
        else:
            outcome.passed += 1
    return outcome


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4, help="notebooks run at once (pytest-xdist; default 4)")
    args = parser.parse_args(argv)
    gpus, why_not = where()
    if gpus is None:
        print(f"make test-gpu: {why_not}: nothing run")
        return 0
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NBFSDP_DEVICE": "cuda", "NBFSDP_PREWARM": "0"}
    spread = ["-n", str(args.workers), "--dist", "loadfile"] if _xdist() and args.workers > 1 else []
    started = time.monotonic()
    runs = {
        "tests": _start("tests", ["-m", "gpu", *gpu_test_files()], env),
        "notebooks": _start("notebooks", ["--nbval-lax", *spread, "notebooks"], env),
    }
    outcomes = {name: _read(report, process.wait()) for name, (process, report) in runs.items()}
    seconds = time.monotonic() - started
    tests, notebooks = outcomes["tests"], outcomes["notebooks"]
    for name, outcome in outcomes.items():
        for failed in outcome.failed:
            print(f"FAILED ({name}): {failed}")
    budget = "" if seconds <= BUDGET_SECONDS else f" (over the {BUDGET_SECONDS // 60} minutes it is sized for)"
    print(
        f"make test-gpu: {gpus}: GPU tests {tests.passed} passed, {len(tests.failed)} failed, {tests.skipped} "
        f"skipped; notebooks {len(notebooks.files) - len(notebooks.files_failed)} of {len(notebooks.files)} "
        f"passed ({notebooks.passed} cells passed, {len(notebooks.failed)} failed); {seconds:.0f} s{budget}; "
        f"logs in {ARTIFACTS.relative_to(REPO)}/"
    )
    return 0 if all(not o.failed and o.returncode == 0 for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
