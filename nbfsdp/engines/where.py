"""Where a rank is, asked from the notebook while its cell runs: ``%fsdp where`` (the ranks' side).

Two parts, both started once per engine process by ``engine.setup``:

- a **ledger of collectives**: ``torch.distributed``'s collective functions wrapped, so each call is
  counted per process group (numbered as every rank of the group must issue them: the n-th collective of
  a group must be the same on all its ranks) with its operation, its first tensor's shape and dtype, and
  the line of the cell or library that issued it (its code object and line number, made words only when
  the notebook asks); the one a rank is inside, while it is. FSDP2, DCP and
  a cell's own ``dist.all_reduce`` call these functions by their module attribute, so one wrapper sees
  them all. (NCCL's flight recorder keeps a similar record, but only for NCCL and only when enabled; gloo
  has none. Functional collectives, which DTensor's redistributions use, go through ``torch.ops`` and
  are not counted.)
- a **watcher thread** that answers requests in a directory the notebook and the rank share: each
  answer is the main thread's Python stack (``sys._current_frames``) and the ledger. A rank blocked in
  a collective has released the GIL, so the thread answers while the cell hangs. Requests are files,
  looked for every ``POLL_SECONDS``: one ``stat`` each time, nothing else.

A wrapper costs a Python call per collective: a few microseconds, for the frames it walks to the issuing line
(each library frame's code object is looked up in a set once it is known); ``make bench``'s ``where_ledger`` row
measures it against a step of the GPT-2 loop.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch
import torch.distributed as dist

from nbfsdp.shared.protocol import where_answer, where_request

#: The collective functions counted (those this torch has).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "gather", "gather_object",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
)  # fmt: skip
#: Seconds between looks for a request.
POLL_SECONDS = 0.25
#: The most recent collectives an answer carries, per group.
RECENT = 8


class Ledger:
    """Every collective this process issued since its world began, by process group."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, ...], int] = collections.Counter()
        self.recent: dict[tuple[int, ...], collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=RECENT)
        )
        self.inside: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def reset(self) -> None:
        """A new world: its collectives are numbered from 1."""
        _RANKS.clear()
        with self._lock:
            self.counts.clear()
            self.recent.clear()
            self.inside = None

    def wrap(self, name: str, function: Any) -> Any:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            entry = self._enter(name, args, kwargs)
            try:
                return function(*args, **kwargs)
            finally:
                if self.inside is entry:
                    self.inside = None

        counted.__wrapped_by_nbfsdp__ = True  # type: ignore[attr-defined]  # a mark on the function
        return counted

    def _enter(self, name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
        group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
        ranks = _group_ranks(group)
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        with self._lock:
            self.counts[ranks] += 1
            entry = {
                "op": name,
                "seq": self.counts[ranks],
                "group": list(ranks),
                "tensor": (tensor.shape, tensor.dtype) if tensor is not None else None,  # words on answering
                "at": _caller(),  # words on answering
                "since": time.time(),
            }
            self.recent[ranks].append(entry)
            self.inside = entry
        return entry

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "groups": [
                    {"ranks": list(ranks), "count": count, "recent": [_words(e) for e in self.recent[ranks]]}
                    for ranks, count in self.counts.items()
                ],
                "inside": _words(self.inside) if self.inside else None,
            }


def _words(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry as the notebook reads it: its tensor and the line that issued it in words."""
    tensor, at = entry["tensor"], entry["at"]
    shape = f"{list(tensor[0])} {str(tensor[1]).removeprefix('torch.')}" if tensor else ""
    line = f"{at[0].co_filename}:{at[1]} in {at[0].co_name}" if at else ""
    return {**entry, "tensor": shape, "at": line}


#: Each process group's global ranks, by the group's id (the group kept with them, so the id stays its own).
_RANKS: dict[int, tuple[dist.ProcessGroup | None, tuple[int, ...]]] = {}


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The global ranks of ``group`` (the default group where none is given)."""
    group = group or dist.group.WORLD
    known = _RANKS.get(id(group))
    if known is not None and known[0] is group:
        return known[1]
    try:
        ranks = tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError):  # no world, or a group this rank is not in
        return ()
    _RANKS[id(group)] = (group, ranks)
    return ranks


_LIBRARIES = ("torch" + os.sep, "nbfsdp" + os.sep + "engines")
#: Code objects of torch and nbfsdp's engine code met so far, by id (a code object's own hash is computed anew
#: from its fields at each lookup; each is kept here, so its id is never another's): an FSDP2 collective is
#: issued some 20 frames below the cell's line, and a lookup per frame costs less than reading its file name.
_LIBRARY_CODE: dict[int, CodeType] = {}


def _caller() -> tuple[CodeType, int] | None:
    """The first frame outside torch and nbfsdp's engine code, as its code object and line number: the line
    that issued the collective (for FSDP2's own, the cell's line that ran the model). ``_words`` says it."""
    frame: FrameType | None = sys._getframe(3)
    while frame is not None:
        code = frame.f_code
        if id(code) not in _LIBRARY_CODE:
            if not any(library in code.co_filename for library in _LIBRARIES):
                return code, frame.f_lineno
            _LIBRARY_CODE[id(code)] = code
        frame = frame.f_back
    return None


ledger = Ledger()
_installed = False


def install() -> None:
    """Count every collective this process issues (once per process)."""
    global _installed
    if _installed:
        return
    for name in COLLECTIVES:
        for module in (dist, dist.distributed_c10d):
            function = getattr(module, name, None)
            if function is not None and not getattr(function, "__wrapped_by_nbfsdp__", False):
                setattr(module, name, ledger.wrap(name, function))
    _installed = True


class _Watcher:
    """The thread that answers the notebook's requests for this rank (one per process, re-aimed per world)."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self.rank = -1
        self.answered = 0
        self._thread = threading.Thread(target=self._serve, name="nbfsdp-where", daemon=True)
        main = threading.main_thread().ident
        assert main is not None  # the main thread has started: it runs this
        self._main = main
        self._thread.start()

    def _serve(self) -> None:
        while True:
            time.sleep(POLL_SECONDS)
            directory = self.directory
            if directory is None:
                continue
            try:
                number = int(Path(where_request(directory)).read_text())
            except (OSError, ValueError):
                continue
            if number > self.answered:
                self.answered = number
                self._answer(directory, number)

    def _answer(self, directory: str, number: int) -> None:
        frame = sys._current_frames().get(self._main)
        stack = traceback.format_stack(frame) if frame is not None else []
        answer = {
            "rank": self.rank,
            "pid": os.getpid(),
            "at": time.time(),
            "stack": stack,
            "in_cell": any('File "<fsdp-cell-' in line for line in stack),
            "ledger": ledger.as_dict(),
        }
        path = Path(where_answer(directory, number, self.rank))
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(answer))
        partial.replace(path)  # whole or absent, for the notebook reading it


_watcher: _Watcher | None = None


def watch(directory: str | None, rank: int) -> None:
    """Answer the notebook's requests in ``directory`` as ``rank`` (a new world); None: answer none."""
    global _watcher
    install()
    ledger.reset()
    if _watcher is None:
        _watcher = _Watcher()
    _watcher.rank = rank
    _watcher.answered = _last_request(directory)
    _watcher.directory = directory


def _last_request(directory: str | None) -> int:
    """The request already in ``directory`` (an older world's): not answered again."""
    if directory is None:
        return 0
    try:
        return int(Path(where_request(directory)).read_text())
    except (OSError, ValueError):
        return 0
