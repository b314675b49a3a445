"""The peak ``explain`` predicts for a running ``%%fsdp`` cell, traced in a thread beside it.

The dashboard draws each rank's predicted peak beside its measured one, and ``last_run().predicted_peak``
keeps it. The step is traced (``nbfsdp.kernel.planning.peak``) with the batch the cell trains on, where the kernel
can know it without running the cell: the first batch of the notebook DataLoader it reads (one without
worker processes: taking a batch from one with workers would start them), else the batch of the last
``explain`` of that model with ``--batch``. The loss is that explain's ``loss``, else the output's
``loss`` or its sum, as ``explain`` takes it; a ``with torch.autocast(...)`` in the cell's code is traced
as autocast. A cell with neither batch is traced with the shapes rank 0's model was first called with, once
the rank sends them (``nbfsdp.engines.memory_limit``): the batch the ranks actually use.

The loader's batch is taken in the kernel's thread before the cell runs, its shuffling left where it was
(the ranks' loaders must draw what they would have); the trace runs on a meta copy of the model in a
thread of its own, while the ranks work. Runs in the notebook's kernel.
"""

from __future__ import annotations

import ast
import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from nbfsdp.kernel.cluster.threads import KernelThread
from nbfsdp.kernel.planning import peak
from nbfsdp.kernel.planning.workload import StepInputs, Workload, first_batch, on_meta
from nbfsdp.shared import transfer
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.protocol import TensorShape
from nbfsdp.shared.torch_private import tree_map

#: The last ``explain(..., batch=...)`` of each notebook model, its batch as meta tensors (shapes alone: the
#: notebook's tensors are not kept alive by it).
_explained: weakref.WeakKeyDictionary[nn.Module, Workload] = weakref.WeakKeyDictionary()


def remember(model: nn.Module, workload: Workload) -> None:
    """``explain`` planned ``model`` with ``workload``: a cell that trains it on no loader traces with it."""
    _explained[model] = dataclasses.replace(workload, batch=on_meta(first_batch(workload.batch)))


def workload_of_call(call: Any, loss: Any = None, autocast: torch.dtype | None = None) -> Workload | None:
    """A rank's call of its model, ``(args, kwargs)`` of ``TensorShape``s, as the per-rank batch a step traces
    (None: the model was never called)."""
    if call is None:
        return None

    def meta(leaf: Any) -> Any:
        return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta") if isinstance(leaf, TensorShape) else leaf

    args, kwargs = tree_map(meta, call)
    given: Any = kwargs if kwargs else (args[0] if len(args) == 1 else tuple(args))
    return Workload(given, loss, per_rank_batches=True, autocast=autocast)


def cell_workload(
    model: nn.Module, loaders: list[Any], *, per_rank_batches: bool, autocast: torch.dtype | None
) -> Workload | None:
    """What a cell that trains ``model`` on ``loaders`` (the notebook DataLoaders it reads) runs a step on,
    under ``autocast`` (``cell_autocast``), or None where the kernel cannot know."""
    explained = _explained.get(model)
    for loader in loaders:
        if isinstance(loader, DataLoader) and loader.num_workers == 0:
            batch = on_meta(first_batch(loader))
            return Workload(batch, explained.loss if explained else None, per_rank_batches, autocast=autocast)
    return dataclasses.replace(explained, autocast=autocast) if explained else None


def cell_autocast(cell: str, devices: Devices) -> torch.dtype | None:
    """The dtype of the ``with torch.autocast(...)`` a cell's code runs its model under, read from its code:
    ``dtype=torch.bfloat16`` or ``torch.float16``, else autocast's default on the ranks' device (fp16 on a
    GPU, bf16 on the CPU); None where it has none (or ``enabled=False``)."""
    for node in ast.walk(ast.parse(cell)):
        if not isinstance(node, (ast.With, ast.AsyncWith)):
            continue
        for item in node.items:
            call = item.context_expr
            if not isinstance(call, ast.Call):
                continue
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            keywords = {k.arg: k.value for k in call.keywords}
            enabled = keywords.get("enabled")
            if name != "autocast" or (isinstance(enabled, ast.Constant) and not enabled.value):
                continue
            if isinstance(dtype := keywords.get("dtype"), ast.Attribute):
                return _DTYPES.get(dtype.attr, torch.bfloat16)
            return torch.float16 if devices.type == "cuda" else torch.bfloat16
    return None


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


class PeakPrediction:
    """Each rank's predicted peak of one cell (bytes), traced in a daemon thread; ``done`` receives it."""

    def __init__(
        self,
        model: nn.Module,
        config: FSDPConfig,
        devices: Devices,
        workload: Workload,
        done: Callable[[list[int], str], None],
    ) -> None:
        """``done(peaks, described)`` gets the peaks and the batch share they were traced with, in words.
        The thread copies ``model`` onto the meta device first: ``copied`` waits for that, before the
        notebook's model takes the trained weights back."""
        self.peaks: list[int] | None = None
        self.parts: list[dict[str, int]] | None = None
        """Each rank's bytes by category at its traced peak (``Peak.as_dict``)."""
        self.error: BaseException | None = None
        self._copied = threading.Event()

        def trace() -> tuple[list[peak.Peak], StepInputs]:
            try:
                meta = transfer.meta_copy(model)
            finally:
                self._copied.set()
            return peak.rank_peaks(meta, config, devices, workload)

        self._thread = KernelThread(target=self._run, args=(trace, done), name="nbfsdp-predicted-peak")
        self._thread.start()

    def copied(self) -> None:
        """Until the model is copied (a fraction of the cell's first moments)."""
        self._copied.wait()

    def _run(
        self, trace: Callable[[], tuple[list[peak.Peak], StepInputs]], done: Callable[[list[int], str], None]
    ) -> None:
        try:
            peaks, inputs = trace()
        except Exception as error:  # a model the trace cannot run (meta-unfriendly code): no prediction
            self.error = error
            return
        self.peaks = [p.total for p in peaks]
        self.parts = [p.as_dict() for p in peaks]
        done(self.peaks, inputs.described)

    def wait(self, seconds: float) -> None:
        """Give the trace up to ``seconds`` more (the cell has ended: its final figure should show it)."""
        self._thread.join(seconds)
