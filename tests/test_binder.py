"""The Binder files alone make an environment that runs the quick start.

Binder (repo2docker) installs ``binder/requirements.txt``, then runs ``binder/postBuild`` in the
repository root; this does the same in a fresh virtual environment and executes the quick start
there with nbconvert, so a dependency the package gains but the Binder files miss fails here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_binder_environment_runs_the_quick_start(tmp_path):
    source = tmp_path / "repo"  # the repository's files as Binder clones them (no venv, no build outputs)
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    files = subprocess.run(listing, cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    venv = tmp_path / "binder-env"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, dict(os.environ))
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    env.pop("PYTHONPATH", None)
    # pip byte-compiles every module it installs (torch's, JupyterLab's: thousands the quick start never imports);
    # compiled as imported instead, once, into .pyc files the next process reads. What gets installed is the same
    env["PIP_NO_COMPILE"] = "1"
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PIP_RETRIES"] = "0"  # this machine reaches package registries only: PyTorch's own index fails fast
    # Binder's CPU index gives a CPU build; where that index is out of reach, the newest torch pip finds may be a
    # CUDA build of several GB (5.8 GB seen here), so pin the release this suite runs on, which Binder's index has
    pin = tmp_path / "torch-pin.txt"
    pin.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    env["PIP_CONSTRAINT"] = str(pin)
    _run(["python", "-m", "pip", "install", "--quiet", "-r", "binder/requirements.txt"], source, env)
    _run(["bash", "binder/postBuild"], source, env)
    notebook = source / "notebooks" / "00-quickstart.ipynb"
    _run(
        ["python", "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace"]
        + ["--ExecutePreprocessor.timeout=600", str(notebook)],
        source / "notebooks",
        env,
    )
    executed = notebook.read_text()
    shutil.rmtree(venv)  # pytest keeps three runs' temporary folders: a venv in each is gigabytes of disk
    assert '"output_type": "error"' not in executed and "continues 3 4 5 6 as" in executed
