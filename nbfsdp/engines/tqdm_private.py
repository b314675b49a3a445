"""The private tqdm API nbfsdp relies on, in one place (the ranks' progress bars): the file under tqdm's
wrappers of a bar's output. ``tests/test_progress.py`` draws real bars through it.
"""

from __future__ import annotations

from typing import Any

from tqdm import utils


def unwrapped(fp: Any) -> Any:
    """The file a bar writes to, under tqdm's ``ObjectWrapper``s (``DisableOnWriteError``, ...): their
    ``_wrapped``."""
    while isinstance(fp, utils.ObjectWrapper):
        fp = fp._wrapped
    return fp
