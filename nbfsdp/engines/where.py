"""Where a rank is, asked from the notebook while its cell runs: ``%fsdp where`` (the ranks' side).

Two parts, both started once per engine process by ``engine.setup``:

- a **ledger of collectives**: it watches ``torch.distributed``'s collective functions through the one
  wrapper of them (``shared.collective_calls``, which the course's ``CollectiveMeter`` shares), so each call is
  counted per process group (numbered as every rank of the group must issue them: the n-th collective of
  a group must be the same on all its ranks) with its operation and its first tensor's shape and dtype
  (made words only when the notebook asks); the one a rank is inside, while it is. Where torch's flight
  recorder records (``TORCH_FR_BUFFER_SIZE``: nbfsdp turns it on for NCCL worlds), its last entries come
  with each answer too: NCCL's own view, with each kernel's state (scheduled, started, completed).
- a **watcher thread** that answers requests in a directory the notebook and the rank share: each
  answer is the main thread's Python stack (``sys._current_frames``) and the ledger, with the line of the
  cell or library that issued the collective the rank is inside, read from that stack. A rank blocked in
  a collective has released the GIL, so the thread answers while the cell hangs. Requests are files,
  looked for every ``POLL_SECONDS``: one ``stat`` each time, nothing else.

A collective costs the ledger a count and an entry, and no frame: the issuing line is found only when the
notebook asks, on the stack the rank is waiting in. ``make bench``'s ``where_ledger`` row measures the ledger's
time against a step of the GPT-2 loop.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from nbfsdp.shared import collective_calls, torch_private
from nbfsdp.shared.protocol import where_answer, where_request

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
        self.pending: list[tuple[dict[str, Any], dist.Work]] = []
        """Collectives issued with ``async_op=True`` (FSDP2's all-gathers on CPU ranks) and their ``Work``, until
        it completes: a rank blocked in its wait is inside the oldest one not completed."""
        self._lock = threading.Lock()

    def reset(self) -> None:
        """A new world: its collectives are numbered from 1."""
        _RANKS.clear()
        with self._lock:
            self.counts.clear()
            self.recent.clear()
            self.inside = None
            self.pending.clear()

    def entered(self, name: str, function: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
        """A collective call begins (``collective_calls``' watcher): counted, and the one this rank is in."""
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
                "since": time.time(),
            }
            self.recent[ranks].append(entry)
            self.inside = entry
        return entry

    def left(self, entry: dict[str, Any]) -> None:
        if self.inside is entry:
            self.inside = None

    def issued(self, entry: dict[str, Any], work: dist.Work) -> None:
        """``entry`` was issued with ``async_op=True``: it is pending until ``work`` completes."""
        with self._lock:
            self.pending = [(e, w) for e, w in self.pending if not w.is_completed()]
            self.pending.append(({**entry, "async": True}, work))

    def waited_on(self) -> dict[str, Any] | None:
        """The collective this rank is in: the one its thread is inside, else the oldest async one not done."""
        if self.inside is not None:
            return self.inside
        with self._lock:
            return next((e for e, w in self.pending if not w.is_completed()), None)

    def as_dict(self, inside_at: str = "") -> dict[str, Any]:
        """The ledger as the notebook reads it; ``inside_at``: the line that issued the collective the rank is
        inside (``issuing_line``; the others' lines are not kept)."""
        inside = self.waited_on()
        with self._lock:
            return {
                "groups": [
                    {"ranks": list(ranks), "count": count, "recent": [_words(e, "") for e in self.recent[ranks]]}
                    for ranks, count in self.counts.items()
                ],
                "inside": _words(inside, inside_at) if inside else None,
            }


def _words(entry: dict[str, Any], at: str) -> dict[str, Any]:
    """An entry as the notebook reads it: its tensor in words, and the line that issued it."""
    tensor = entry["tensor"]
    shape = f"{list(tensor[0])} {str(tensor[1]).removeprefix('torch.')}" if tensor else ""
    return {**entry, "tensor": shape, "at": at}


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


_LIBRARIES = (
    "torch" + os.sep,
    "nbfsdp" + os.sep + "engines",
    "nbfsdp" + os.sep + "shared" + os.sep + "collective_calls",
)


def issuing_line(frame: FrameType | None, *, waiting: bool = False) -> str:
    """The line that issued the collective a thread is in, from its innermost ``frame``: the first frame above
    ``collective_calls``' wrapper outside torch and nbfsdp's engine code (for FSDP2's own collectives, the cell's line
    that ran the model); "" where the thread is in no wrapped collective (it has just left it). ``waiting``: the
    thread waits on an async collective (no wrapper on its stack): the first such frame on it."""
    past_wrapper = waiting
    while frame is not None:
        code = frame.f_code
        if past_wrapper and not any(library in code.co_filename for library in _LIBRARIES):
            return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
        past_wrapper = past_wrapper or collective_calls.is_wrapper(code)
        frame = frame.f_back
    return ""


ledger = Ledger()


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
        answer = {"rank": self.rank, **answer_of(self._main)}
        path = Path(where_answer(directory, number, self.rank))
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(answer))
        partial.replace(path)  # whole or absent, for the notebook reading it


def answer_of(thread: int) -> dict[str, Any]:
    """What a rank answers of its thread ``thread`` (the main one: the cell's): its stack, the ledger with the
    line that issued the collective it is in, and the flight recorder's last collectives where it records."""
    frame = sys._current_frames().get(thread)
    stack = traceback.format_stack(frame) if frame is not None else []
    return {
        "pid": os.getpid(),
        "at": time.time(),
        "stack": stack,
        "in_cell": any('File "<fsdp-cell-' in line for line in stack),
        "ledger": ledger.as_dict(issuing_line(frame, waiting=ledger.inside is None and bool(ledger.pending))),
        "flight_recorder": flight_recorder(),
    }


#: The flight recorder's variable (torch 2.13's name; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` before it).
FLIGHT_RECORDER = "TORCH_FR_BUFFER_SIZE"
#: The entries it keeps on an NCCL world nbfsdp starts, unless the user set the variable: the default of
#: torchtitan's ``comm.trace_buf_size``.
FLIGHT_RECORDER_ENTRIES = 20000


def record_flights(backend: str) -> None:
    """Before ``init_process_group``: on an NCCL world, turn on the flight recorder (the user's setting wins).
    Its record is NCCL's own (the states of the kernels: scheduled, started, completed), which the ledger above
    cannot see; gloo's, in torch 2.13, is what the ledger has, so it stays off there unless asked for."""
    if backend == "nccl":
        os.environ.setdefault(FLIGHT_RECORDER, str(FLIGHT_RECORDER_ENTRIES))


def flight_recorder(last: int = RECENT) -> list[dict[str, Any]]:
    """The flight recorder's ``last`` collectives of this process, oldest first (none where it is off): each
    its process group, its number there, its operation, input sizes and state."""
    if int(os.environ.get(FLIGHT_RECORDER, "0") or 0) <= 0:
        return []
    try:
        entries = torch_private.flight_recorder_entries()
    except (RuntimeError, pickle.UnpicklingError):  # a dump while the process group goes
        return []
    return [
        {
            "group": str(entry["process_group"][1]),
            "seq": entry["collective_seq_id"],
            "op": entry["profiling_name"],
            "sizes": entry["input_sizes"],
            "state": entry["state"],
        }
        for entry in entries[-last:]
    ]


_watcher: _Watcher | None = None


def watch(directory: str | None, rank: int) -> None:
    """Answer the notebook's requests in ``directory`` as ``rank`` (a new world); None: answer none."""
    global _watcher
    collective_calls.watch(ledger)  # every collective this process issues, counted from now on
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
