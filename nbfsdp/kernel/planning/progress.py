"""The line ``--suggest`` keeps up to date while it searches: how many settings it has traced, of how many, and
for how long. Runs in the notebook's kernel.

A search over a large model's settings takes seconds; a planner that says nothing for that long looks hung.
"""

from __future__ import annotations

import sys
import time

from IPython import get_ipython
from IPython.display import DisplayHandle, display


class ProgressLine:
    """One line, rewritten in place: in a notebook a display of its own, elsewhere stderr with a carriage return."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._started = time.monotonic()
        self._in_kernel = getattr(get_ipython(), "kernel", None) is not None
        self._handle: DisplayHandle | None = None
        self.shown = ""
        """The line as it reads now."""
        self.tried = 0

    def searched(self, tried: int, known: int) -> None:
        """``fitting.suggest``'s progress: ``tried`` settings of the ``known`` ones so far."""
        self.tried = tried
        self._show(f"{self._what}: {tried} of {known} settings traced ({time.monotonic() - self._started:.1f} s)")

    def done(self) -> None:
        elapsed = time.monotonic() - self._started
        self._show(f"{self._what}: {self.tried} settings traced in {elapsed:.1f} s", last=True)

    def _show(self, text: str, *, last: bool = False) -> None:
        self.shown = text
        if self._in_kernel:
            if self._handle is None:
                self._handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self._handle.update({"text/plain": text}, raw=True)
        else:
            sys.stderr.write(f"\r{text}" + ("\n" if last else ""))
            sys.stderr.flush()
