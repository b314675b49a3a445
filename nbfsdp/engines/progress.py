"""Progress bars on the engines (the ranks): rank 0's drawn in the notebook, the others' silent.

A ``tqdm`` bar in a cell would otherwise draw on every rank, with ``\\r`` rewrites that reach the
notebook only once a line ends, or (``tqdm.notebook``, ``tqdm.auto``) as a widget no frontend ever
sees. Every rank keeps the user's own tqdm class and calls, so a bar walks its iterable exactly as
in the plain cell (``tqdm.auto`` calls ``iter()`` in ``__init__``, and each DataLoader iterator
draws a seed), counts, times and closes as there; only the drawing changes. Rank 0 writes each
drawing of a bar as one marked line on stderr, at most once per the bar's ``mininterval`` and once
when it closes (``nbfsdp.shared.protocol.BarDrawing``); ``nbfsdp.kernel.run.runner`` turns those lines
into one display per bar, updated in place. Other ranks draw nothing. A bar the user points at a file
of their own draws there, as usual.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import time
import types
from typing import Any

from nbfsdp.shared.protocol import BarDrawing

_rank: int | None = None
_patched = False
_ids = itertools.count()


def route_bars(rank: int) -> None:
    """Before each cell: bars of this process draw as this module says (patched once; tqdm stays optional)."""
    global _rank, _patched
    _rank = rank
    if not _patched and importlib.util.find_spec("tqdm") is not None:
        _patch()
        _patched = True


class _Nowhere:
    """Takes what tqdm's ``close`` writes around its last drawing (a newline, a carriage return)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class _NoWidget:
    """What ``tqdm.notebook`` keeps in place of its widget here: the attributes it sets, shown nowhere."""

    def __init__(self, total: float | None) -> None:
        def part(**values: Any) -> types.SimpleNamespace:
            return types.SimpleNamespace(layout=types.SimpleNamespace(), style=types.SimpleNamespace(), **values)

        self.children = (part(value=""), part(value=0, max=total, bar_style=""), part(value=""))
        self.layout = types.SimpleNamespace()

    def close(self) -> None:
        pass

    def _ipython_display_(self) -> None:
        pass  # tqdm.notebook displays its widget at once; an engine's display reaches no frontend


def _patch() -> None:
    from tqdm import notebook, std

    from nbfsdp.engines import tqdm_private

    def in_cell(bar: std.tqdm) -> bool:
        """Whether the bar draws where the cell's output goes (not into a file of the user's); decided once,
        as ``close`` swaps its file."""
        if "_nbfsdp_in_cell" not in bar.__dict__:
            fp = tqdm_private.unwrapped(getattr(bar, "fp", None))
            notebook_bar = isinstance(bar, notebook.tqdm_notebook)
            bar._nbfsdp_in_cell = notebook_bar or fp is sys.stderr or fp is sys.stdout
        return bar._nbfsdp_in_cell

    display, clear, close = std.tqdm.display, std.tqdm.clear, std.tqdm.close

    def std_display(self: std.tqdm, msg: str | None = None, pos: int | None = None) -> bool | None:
        return _draw(self, msg) if in_cell(self) else display(self, msg, pos)

    def std_clear(self: std.tqdm, nolock: bool = False) -> None:  # noqa: FBT001, FBT002 (tqdm.clear's signature)
        if not in_cell(self):
            clear(self, nolock)

    def std_close(self: std.tqdm) -> None:
        if getattr(self, "disable", True) or not in_cell(self):
            return close(self)
        fp, self.fp = self.fp, _Nowhere()
        try:
            close(self)
        finally:
            self.fp = fp

    def notebook_display(self: notebook.tqdm_notebook, msg: str | None = None, *_: Any, **signals: Any) -> bool:
        return _draw(self, "" if signals.get("close") else msg)

    std.tqdm.display, std.tqdm.clear, std.tqdm.close = std_display, std_clear, std_close
    notebook.tqdm_notebook.display = notebook_display
    notebook.tqdm_notebook.status_printer = staticmethod(_no_widget)


def _no_widget(file: Any, total: float | None = None, desc: str | None = None, ncols: Any = None) -> _NoWidget:
    """``tqdm.notebook``'s ``status_printer`` here: builds no widget."""
    return _NoWidget(total)


def _draw(bar: Any, msg: str | None) -> bool:
    """Rank 0: the bar's text as a marked line, throttled, its last one (``close`` has set ``disable``) always."""
    if _rank != 0:
        return True
    ended = bool(bar.disable)
    now = time.monotonic()
    if "_nbfsdp_bar" not in bar.__dict__:
        bar._nbfsdp_bar = [str(next(_ids)), -float("inf")]  # its id, when it was last drawn
    state = bar._nbfsdp_bar
    if not ended and now - state[1] < bar.mininterval:
        return True
    state[1] = now
    text = _text(bar) if msg is None else msg
    sys.stderr.write(BarDrawing(bar=state[0], ended=ended, text=text).line())
    sys.stderr.flush()  # the engine's stream otherwise waits for its own flush interval
    return True


def _text(bar: Any) -> str:
    """The bar as ``tqdm.tqdm`` prints it (a width the notebook class keeps as text, "100%", ignored)."""
    meter = bar.format_dict
    if not isinstance(meter.get("ncols"), int):
        meter["ncols"] = None
    return bar.format_meter(**meter)
