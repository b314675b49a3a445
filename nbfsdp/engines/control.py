"""Steering a running cell from the notebook (the ranks' side): changes and cancel, applied at a step boundary.

The notebook (``nbfsdp.kernel.control``) writes the request file; see there
how the ranks agree on the boundary without a collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn as nn

from nbfsdp.shared.protocol import ControlRequest, claim_file


class CellCancelled(BaseException):
    """Raised from ``nbfsdp.log`` on every rank at the agreed step; a BaseException so user code's
    ``except Exception`` does not swallow it. The cell then ends as a successful one would."""


class RankControl:
    """A rank's side: at each step boundary, notice new requests and apply them at the agreed one."""

    def __init__(self, path: str, apply: Callable[[dict[str, Any]], list[str]]) -> None:
        self._path = Path(path)
        self._apply = apply
        self._stamp: tuple[int, int] | None = None
        self._seen = 0
        self._pending: tuple[int, ControlRequest] | None = None  # (claimed call, request)

    def at_boundary(self, call: int) -> list[str]:
        """Called at boundary number ``call``; returns the settings changed here, or raises CellCancelled."""
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            return []
        if (stat.st_ino, stat.st_mtime_ns) != self._stamp:
            self._stamp = (stat.st_ino, stat.st_mtime_ns)
            request = ControlRequest.from_json(self._path.read_text())
            if request.version > self._seen:
                self._seen = request.version
                self._pending = (self._claim(request.version, call + 1), request)
        if self._pending is None or call < self._pending[0]:
            return []
        request = self._pending[1]
        self._pending = None
        changed = self._apply(request.settings)
        if request.cancel:
            raise CellCancelled
        return changed

    def _claim(self, version: int, call: int) -> int:
        """The call at which ``version`` applies: ours, unless another rank claimed first."""
        claim = claim_file(self._path, version)
        mine = claim.with_name(f"{claim.name}.{os.getpid()}")
        mine.write_text(str(call))
        try:
            os.link(mine, claim)
        except FileExistsError:
            pass
        finally:
            mine.unlink()
        return int(claim.read_text())


class StepBoundaries:
    """The start of every forward of the cell's models as the step boundary, on every rank.

    A forward pre-hook put first, ahead of FSDP2's own (which gathers the root): a change then
    applies while every parameter is sharded, and a cancel ends the cell before the step begins.
    ``on_change`` hears what changed (the cell's records mark it at the next log call).
    """

    def __init__(self, models: list[nn.Module], control: RankControl, on_change: Callable[[list[str]], None]) -> None:
        self._control = control
        self._on_change = on_change
        self._forwards = 0
        self._handles = [model.register_forward_pre_hook(self._at_forward, prepend=True) for model in models]

    def _at_forward(self, module: nn.Module, args: Any) -> None:
        changed = self._control.at_boundary(self._forwards)
        self._forwards += 1
        if changed:
            self._on_change(changed)

    def remove(self) -> None:
        """Take the hooks off: the models outlive the cell."""
        for handle in self._handles:
            handle.remove()
