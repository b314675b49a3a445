"""The course under nbval: a notebook that needs a newer torch, or a library a user brings, is skipped whole.

A notebook says what it needs in its metadata, ``{"nbfsdp": {"min_torch": "2.8", "needs": ["peft"]}}``, and
in its first cell for a reader. Below that torch, or without that library, each of its cells is reported
skipped with the reason, before nbval starts its kernel: the floor run (torch 2.6, ``make test-floor-course``)
runs every notebook that can run there, and names the others.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from packaging.version import Version


def why_skipped(metadata: dict) -> str | None:
    """Why a notebook with this ``nbfsdp`` metadata cannot run in this environment, or None."""
    wanted = metadata.get("min_torch")
    have = Version(torch.__version__.split("+")[0])
    if wanted and have < Version(wanted):
        return f"needs torch >= {wanted} (this is {have})"
    missing = [name for name in metadata.get("needs", []) if importlib.util.find_spec(name) is None]
    if missing:
        return f"needs {', '.join(missing)} (pip install {' '.join(missing)})"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        notebook = getattr(item.parent, "nb", None)
        if notebook is None:
            continue
        reason = why_skipped(notebook.metadata.get("nbfsdp", {}))
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))  # -rs prints the notebook beside it
