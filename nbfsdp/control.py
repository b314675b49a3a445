"""Steering a running cell from the notebook: settings changes and cancel, applied at a step boundary.

The notebook writes the wanted live settings (and a cancel flag) to a request
file in the cluster's private directory; every rank looks at it, one ``stat``,
at each step boundary: the start of a forward of the cell's models
(``StepBoundaries``), or, in a cell without a model, each ``nbfsdp.log`` call.
A forward is the boundary because every rank runs the same forwards (their
collectives must match) whether it logs on every rank, on one, or never; a
change applied at a log call would switch only the ranks that log.

All ranks must switch at the same boundary, yet no collective may be added
there (it would hang or reorder the cell's own). So the ranks agree through
the file system: the first rank to see request version v at its boundary
``a`` claims boundary ``a + 1`` for it (``os.link`` is atomic and fails if
another rank claimed first), and every rank applies v at the claimed one.
A training step holds collectives, so no rank passes a whole boundary ahead
of another: a rank that first sees v at boundary ``b`` has ``b <= a + 1``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.nn as nn


class CellCancelled(BaseException):
    """Raised from ``nbfsdp.log`` on every rank at the agreed step; a BaseException so user code's
    ``except Exception`` does not swallow it. The cell then ends as a successful one would."""


def _write_atomically(path: Path, payload: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(payload))
    partial.replace(path)


class RunControl:
    """The notebook's side: what the running cell should switch to, versioned."""

    def __init__(self, directory: str, run_id: int) -> None:
        self.path = Path(directory, f"control-{run_id}.json")
        self.version = 0
        self.settings: dict[str, Any] = {}
        self.cancelled = False
        self._publish()

    def change(self, settings: dict[str, Any]) -> None:
        """Ask every rank to switch to ``settings`` (live keys only) at the next step boundary."""
        self.settings.update(settings)
        self.version += 1
        self._publish()

    def cancel(self) -> None:
        """Ask every rank to end the cell cleanly at the next step boundary."""
        self.cancelled = True
        self.version += 1
        self._publish()

    def _publish(self) -> None:
        _write_atomically(self.path, {"version": self.version, "settings": self.settings, "cancel": self.cancelled})

    def remove(self) -> None:
        for leftover in self.path.parent.glob(f"{self.path.stem}*"):
            leftover.unlink(missing_ok=True)


class RankControl:
    """A rank's side: at each step boundary, notice new requests and apply them at the agreed one."""

    def __init__(self, path: str, apply: Callable[[dict[str, Any]], list[str]]) -> None:
        self._path = Path(path)
        self._apply = apply
        self._stamp: tuple[int, int] | None = None
        self._seen = 0
        self._pending: tuple[int, dict[str, Any]] | None = None  # (claimed call, request)

    def at_boundary(self, call: int) -> list[str]:
        """Called at boundary number ``call``; returns the settings changed here, or raises CellCancelled."""
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            return []
        if (stat.st_ino, stat.st_mtime_ns) != self._stamp:
            self._stamp = (stat.st_ino, stat.st_mtime_ns)
            request = json.loads(self._path.read_text())
            if request["version"] > self._seen:
                self._seen = request["version"]
                self._pending = (self._claim(request["version"], call + 1), request)
        if self._pending is None or call < self._pending[0]:
            return []
        request = self._pending[1]
        self._pending = None
        changed = self._apply(request["settings"])
        if request["cancel"]:
            raise CellCancelled
        return changed

    def _claim(self, version: int, call: int) -> int:
        """The call at which ``version`` applies: ours, unless another rank claimed first."""
        claim = self._path.with_name(f"{self._path.stem}-v{version}.claim")
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
