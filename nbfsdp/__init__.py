"""nbfsdp: train a notebook's PyTorch model with FSDP2 across processes, from a cell.

    %load_ext nbfsdp
    model = Net()

    %%fsdp --world-size 2
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ...
    nbfsdp.log(step=step, loss=loss.item())

Afterwards ``model`` holds the trained weights and ``nbfsdp.last_run()`` the
metrics of every rank. See ``notebooks/00-quickstart.ipynb``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbfsdp.comparison import compare
from nbfsdp.explain import Plan, explain
from nbfsdp.history import RunRecord, last_run, runs
from nbfsdp.metrics import log

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "Plan",
    "RunRecord",
    "compare",
    "explain",
    "last_run",
    "load_ipython_extension",
    "log",
    "runs",
    "unload_ipython_extension",
]

_magics = None


def load_ipython_extension(shell: InteractiveShell) -> None:
    """Register ``%%fsdp`` and ``%fsdp``; a second load keeps the running session."""
    global _magics
    if _magics is not None and _magics.shell is shell:
        return
    from nbfsdp.magics import FSDPMagics

    _magics = FSDPMagics(shell)
    shell.register_magics(_magics)


def unload_ipython_extension(shell: InteractiveShell) -> None:
    """Stop the cluster this extension started."""
    global _magics
    if _magics is not None:
        _magics.stop()
        _magics = None
