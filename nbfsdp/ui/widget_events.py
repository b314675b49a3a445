"""Widget events while a blocking cell runs: the Stop button and live toggles act mid-cell.

A running cell holds the kernel's main shell, where widget messages queue until
it ends. ipykernel 7 runs kernel subshells (JEP 91) on threads of their own and
routes each comm's messages to the subshell the comm answers to, so nbfsdp ties
its controls to one subshell: their handlers run while the cell runs. Kernels
without subshells (ipykernel 6) get jupyter-ui-poll instead, which handles
pending events from inside the cell between looks at the ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ipywidgets as widgets

from nbfsdp.ui.ipykernel_private import create_subshell, has_subshells, route_comm_to_subshell

_subshell_ids: dict[int, str] = {}  # id(kernel) -> nbfsdp's subshell in that kernel


def _kernel() -> Any:
    from IPython import get_ipython

    return getattr(get_ipython(), "kernel", None)


def _subshell(kernel: Any) -> str:
    """nbfsdp's subshell, created once per kernel."""
    if id(kernel) not in _subshell_ids:
        _subshell_ids[id(kernel)] = create_subshell(kernel)
    return _subshell_ids[id(kernel)]


def answer_while_cells_run(controls: Iterable[widgets.Widget]) -> None:
    """Have ``controls``' events handled on nbfsdp's subshell, even while a cell runs.

    ipykernel re-points a comm at the subshell of each message it publishes (a value's
    echo too), so the route is pinned on each comm rather than set once.
    """
    kernel = _kernel()
    if not has_subshells(kernel):
        return
    subshell_id = _subshell(kernel)
    for control in controls:
        route_comm_to_subshell(control.comm, subshell_id)


@contextlib.contextmanager
def pending_events() -> Iterator[Callable[[], None] | None]:
    """Without subshells, a function that handles queued widget events from inside a cell; else None."""
    kernel = _kernel()
    if kernel is None or has_subshells(kernel):
        yield None
        return
    from jupyter_ui_poll import ui_events

    with ui_events() as poll:
        yield lambda: poll(20)
