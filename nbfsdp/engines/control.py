"""Steering a running cell from the notebook (the ranks' side): changes and cancel, applied at a step boundary.

The notebook (``nbfsdp.kernel.run.control``) writes the request file; see there
how the ranks agree on the boundary without a collective.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch.nn as nn
from torch.profiler import record_function

from nbfsdp.shared.protocol import ControlRequest, claim_file


class CellCancelled(BaseException):
    """Raised at the start of the agreed forward on every rank (``StepBoundaries``); a BaseException so user code's
    ``except Exception`` does not swallow it. The cell then ends as a successful one would."""


class StepListener(Protocol):
    """``StepBoundaries``'s ``on_step``: a step begins at forward number ``forward``, ``changed``: with settings
    changed at it."""

    def __call__(self, forward: int, *, changed: bool) -> None: ...


class RankControl:
    """A rank's side: at each step boundary, notice new requests and apply them at the agreed one."""

    def __init__(self, path: str, apply: Callable[[dict[str, Any]], list[str]]) -> None:
        """``path`` '': the ranks share no directory with the notebook, so nothing is steered (all alike)."""
        self._path = Path(path) if path else None
        self._apply = apply
        self._stamp: tuple[int, int] | None = None
        self._seen = 0
        self._pending: tuple[int, ControlRequest] | None = None  # (claimed call, request)

    def at_boundary(self, call: int) -> list[str]:
        """Called at boundary number ``call``; returns the settings changed here, or raises CellCancelled."""
        if self._path is None:
            return []
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
        assert self._path is not None  # poll() read the request from it
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


class PeerEnded(RuntimeError):
    """A peer failed (its own error) while this rank waited for it at a save: a secondary failure."""


class SkippedLog(RuntimeError):
    """A rank did not log a step its peers save at: the save cannot be collective, so the cell ends."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"--save-interval needs nbfsdp.log(step=...) on every rank: {detail}")


#: A rank's progress file: forwards started, last step logged, ended (1) or not: three int64s, written in place.
_PROGRESS = struct.Struct("<qqq")
#: How often a rank waiting for its peers at a save looks at their files.
_POLL_SECONDS = 0.002


class SaveAgreement:
    """Before each interval save, the ranks agree through files that every one of them is at that log call.

    The save is collective: a rank that skipped the log (``if rank == 0: nbfsdp.log(...)``) would
    leave its peers in DCP's collectives and itself in the next forward's, both waiting until the
    timeout. No collective can ask either, so each rank keeps a progress file in the cell's markers
    directory (forwards started, last step logged, ended), rewritten in place at each forward and log,
    and at a due log writes ``due-<step>.rank<r>`` with its forward count F, then waits until every
    peer has written its own. A peer that started forward F + 1, logged a later step, or ended the cell
    first has skipped it: the waiting rank raises ``SkippedLog``, and so does the skipping rank at its
    next forward or log if it sees the marker first. Either error tears the world down, so the other
    ranks fail too at once. Ranks run the same forwards (FSDP's collectives demand it), so F is the same
    on every rank that logs.
    """

    def __init__(self, directory: str, rank: int, world_size: int) -> None:
        self._dir = Path(directory)
        self._rank, self._world_size = rank, world_size
        self._forwards, self._step, self._ended = 0, -1, 0
        self._fd = os.open(self._dir / f"progress.rank{rank}", os.O_RDWR | os.O_CREAT, 0o600)
        self._write()
        self._agreed: set[int] = set()  # due steps this rank logged too

    def _write(self) -> None:
        os.pwrite(self._fd, _PROGRESS.pack(self._forwards, self._step, self._ended), 0)

    def _progress(self, rank: int) -> tuple[int, int, int]:
        try:
            data = (self._dir / f"progress.rank{rank}").read_bytes()
        except FileNotFoundError:
            return 0, -1, 0  # that rank has not begun the cell yet
        return _PROGRESS.unpack(data) if len(data) == _PROGRESS.size else (0, -1, 0)

    def _marker(self, step: int, rank: int) -> Path:
        return self._dir / f"due-{step}.rank{rank}"

    def at_forward(self) -> None:
        """A forward begins (before FSDP's all-gather): published, after checking no peer awaits this rank."""
        self._forwards += 1
        self._check_markers()
        self._write()

    def at_log(self, step: int, *, due: bool) -> None:
        """A log call; when ``due``, return only once every rank is at this one (then they save together)."""
        self._check_markers(step)
        self._step = step
        self._write()
        if not due:
            return
        mine = self._marker(step, self._rank)
        temporary = mine.with_name(f".{mine.name}")
        temporary.write_text(str(self._forwards))
        os.rename(temporary, mine)  # whole or absent, for the peers reading it
        self._agreed.add(step)
        waiting = set(range(self._world_size)) - {self._rank}
        while waiting:
            for rank in sorted(waiting):
                if self._marker(step, rank).exists():
                    waiting.discard(rank)
                    continue
                forwards, logged, ended = self._progress(rank)
                if ended == 2:
                    raise PeerEnded(f"rank {rank} failed before logging step {step}, where this rank saves")
                if ended or forwards > self._forwards or logged > step:
                    how = "ended the cell" if ended else "went on"
                    raise SkippedLog(f"rank {rank} {how} without logging step {step}, where this rank saves")
            if waiting:
                time.sleep(_POLL_SECONDS)

    def _check_markers(self, step: int | None = None) -> None:
        """Has a peer logged a due step this rank went past? (A listing of a few files: ~10 us a forward.)"""
        for name in os.listdir(self._dir):
            if not name.startswith("due-"):
                continue
            due_step = int(name.removeprefix("due-").split(".")[0])
            if due_step in self._agreed or due_step == step:
                continue
            marker = self._dir / name
            try:
                forwards = int(marker.read_text())
            except (FileNotFoundError, ValueError):
                continue
            if self._forwards > forwards or (step is not None and step > due_step):
                raise SkippedLog(f"this rank did not log step {due_step}, where {name.split('.')[-1]} saves")

    def end(self, *, failed: bool) -> None:
        """The cell ended on this rank (finished or failed): a peer waiting at a save stops waiting."""
        self._ended = 2 if failed else 1
        self._write()
        os.close(self._fd)


class StepBoundaries:
    """The start of every forward of the cell's models as the step boundary, on every rank.

    A forward pre-hook put first, ahead of FSDP2's own (which gathers the root): a change then
    applies while every parameter is sharded, and a cancel ends the cell before the step begins.
    ``on_change`` hears what changed (the cell's records mark it at the next log call).
    """

    def __init__(
        self,
        models: list[nn.Module],
        control: RankControl,
        on_change: Callable[[list[str]], None],
        saves: SaveAgreement | None = None,
        on_step: StepListener | None = None,
    ) -> None:
        """``on_step(forward, changed)``: a step begins at forward number ``forward``, with the settings changed
        at it or not (the timeline's captures start and end here)."""
        self._control = control
        self._on_change = on_change
        self._saves = saves
        self._on_step = on_step
        self._forwards = 0
        self._handles = [model.register_forward_pre_hook(self._at_forward, prepend=True) for model in models]

    def _at_forward(self, module: nn.Module, args: Any) -> None:
        with record_function("nbfsdp::step_boundary"):
            if self._saves is not None:
                self._saves.at_forward()
            changed = self._control.at_boundary(self._forwards)
        self._forwards += 1
        if changed:
            self._on_change(changed)
        if self._on_step is not None:
            self._on_step(self._forwards - 1, changed=bool(changed))

    def remove(self) -> None:
        """Take the hooks off: the models outlive the cell."""
        for handle in self._handles:
            handle.remove()
