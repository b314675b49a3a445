"""nbfsdp: train a notebook's PyTorch model with FSDP2 across processes, from a cell.

    %load_ext nbfsdp
    model = Net()

    %%fsdp --world-size 2
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ...
    nbfsdp.log(step=step, loss=loss.item())

Afterwards ``model`` holds the trained weights and ``nbfsdp.last_run()`` the
metrics of every rank. See ``notebooks/00-quickstart.ipynb``.

``%load_ext nbfsdp`` returns at once: torch, the magics and the engines the first ``%%fsdp`` cell would start
(the default world size: the number of GPUs, or 2) come up on a background thread, so that cell often finds them ready.
The environment variable ``NBFSDP_PREWARM`` chooses: unset, that default world
size; ``0``, ``off``, ``false`` or ``no``, nothing starts before the first cell
(the extension then loads in the foreground); a whole number N from 1 to 64, a
world of N ranks.

Importing the package itself loads no torch: the public names below are
imported on first use (so an engine importing ``nbfsdp`` pays only for what it
runs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from nbfsdp.kernel.extension import load_ipython_extension, unload_ipython_extension
from nbfsdp.kernel.extension import prewarm_world_size as prewarm_world_size  # what NBFSDP_PREWARM asks

if TYPE_CHECKING:
    from nbfsdp.engines.debugging import units
    from nbfsdp.engines.metrics import log
    from nbfsdp.kernel.checkpoints.pretrained import from_pretrained
    from nbfsdp.kernel.checkpoints.sharded import checkpoints, load, save
    from nbfsdp.kernel.comparison import compare
    from nbfsdp.kernel.planning.plans import Plan, explain
    from nbfsdp.kernel.run.gathering import gather, release
    from nbfsdp.kernel.run.history import RunRecord, last_run, runs

__all__ = [
    "Plan",
    "RunRecord",
    "checkpoints",
    "compare",
    "explain",
    "export",
    "from_pretrained",
    "gather",
    "last_run",
    "load",
    "load_ipython_extension",
    "log",
    "release",
    "runs",
    "save",
    "units",
    "unload_ipython_extension",
    "where",
]

#: The public names, and the module each comes from on first use.
_LAZY = {
    "Plan": "nbfsdp.kernel.planning.plans",
    "explain": "nbfsdp.kernel.planning.plans",
    "compare": "nbfsdp.kernel.comparison",
    "RunRecord": "nbfsdp.kernel.run.history",
    "last_run": "nbfsdp.kernel.run.history",
    "runs": "nbfsdp.kernel.run.history",
    "log": "nbfsdp.engines.metrics",
    "save": "nbfsdp.kernel.checkpoints.sharded",
    "load": "nbfsdp.kernel.checkpoints.sharded",
    "checkpoints": "nbfsdp.kernel.checkpoints.sharded",
    "export": "nbfsdp.kernel.checkpoints.exporting",
    "from_pretrained": "nbfsdp.kernel.checkpoints.pretrained",
    "gather": "nbfsdp.kernel.run.gathering",
    "release": "nbfsdp.kernel.run.gathering",
    "where": "nbfsdp.kernel.run.session",
    "units": "nbfsdp.engines.debugging",
}


def __getattr__(name: str) -> Any:
    if name == "_magics":  # the loaded magics (tests and debugging reach the session through them)
        from nbfsdp.kernel import extension

        return extension._magics
    if name not in _LAZY:
        raise AttributeError(f"module 'nbfsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
