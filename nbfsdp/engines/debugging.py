"""The debugger on the ranks (the ranks' side): ``breakpoint()`` in a cell stops the rank with a prompt in the
notebook, and a failed cell's frames stay on its rank for ``%debug``. The kernel's side is
``nbfsdp.kernel.run.debugging``.

A rank's debugger is the standard library's ``pdb.Pdb`` with its input and output replaced, so its commands,
stepping and ``!stmt`` are pdb's own. Only the way a line reaches it differs:

- **At a breakpoint** the cell is running, so the engine takes no ipyparallel request: each prompt is published
  (``datapub``, key ``debug<n>``, with the output before it) and the line typed comes back in a file beside the
  cell's control file (``protocol.debug_command_file``), looked for every ``COMMAND_POLL_SECONDS``. Nothing
  listens: the files are where the cell's live changes already go.
- **After a failed cell** the engine is idle: ``%debug`` sends each line as an ipyparallel call
  (``post_mortem_command``) to the frames ``keep_failure`` kept.

What a learner asks at a prompt is printed for FSDP: ``p`` of a sharded parameter says its local shard, its
placement and its full shape (``describe``), and the ``units`` command (``nbfsdp.units(model)`` in a cell) says
what each FSDP unit holds now: sharded or gathered, an all-gather prefetched, a reduce-scatter pending.
"""

from __future__ import annotations

import datetime
import inspect
import io
import json
import pdb
import pprint
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from nbfsdp.shared import torch_private
from nbfsdp.shared.protocol import CellSpec, debug_command_file

#: How often a rank at a prompt looks for the line typed in the notebook.
COMMAND_POLL_SECONDS = 0.02
_PACKAGE_DIR = str(Path(__file__).parents[1])


class PromptInterrupted(BaseException):
    """The kernel interrupted a rank at its prompt: the cell ends. Not a KeyboardInterrupt, which pdb's own loop
    catches to prompt again."""


class RankDebugger(pdb.Pdb):
    """``pdb.Pdb`` reading its lines from ``ask`` (given the output so far, the prompt and where the rank stands)
    and writing into a buffer; its stack starts at the cell, not at the engine's own frames."""

    def __init__(self, rank: int, ask: Callable[[str, str, str], str] | None = None) -> None:
        self._output = io.StringIO()
        lines = cast(IO[str], _Lines(self._next_line))  # pdb reads only readline() from its stdin
        super().__init__(stdin=lines, stdout=self._output, nosigint=True, readrc=False)
        self.prompt = f"(Pdb rank {rank}) "
        self._ask = ask
        self.on_resume: Callable[..., None] | None = None
        """At a breakpoint: called with the output left once the rank runs on, and whether it quit."""

    def take_output(self) -> str:
        text = self._output.getvalue()
        self._output.seek(0)
        self._output.truncate()
        return text

    def _next_line(self) -> str:
        assert self._ask is not None  # post-mortem lines come through post_mortem_command instead
        frame = self.curframe
        at = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" if frame else ""
        return self._ask(self.take_output().removesuffix(self.prompt), self.prompt, at)

    def setup(self, f: FrameType | None, tb: TracebackType | None) -> Any:
        """pdb's stack, less the engine's frames below the cell (``up`` stops at the cell's own)."""
        rc = super().setup(f, tb)
        cells = [i for i, (frame, _) in enumerate(self.stack) if frame.f_code.co_filename.startswith("<fsdp-cell-")]
        if cells:
            self.stack = self.stack[cells[0] :]
            self.curindex -= cells[0]
        return rc

    def interaction(self, frame: FrameType | None, tb: TracebackType | None) -> None:
        super().interaction(frame, tb)
        if self.on_resume is not None:  # c, n, s, q...: the rank runs on (or ends, quitting)
            self.on_resume(self.take_output(), quit=self.quitting)

    def do_p(self, arg: str) -> None:
        """p expression: print its value; a sharded parameter as its shard, placement and full shape."""
        evaluated, value = self._evaluate(arg)
        if evaluated:
            self.message(describe(value, self._fsdp_models()))

    def do_pp(self, arg: str) -> None:
        """pp expression: pretty-print its value; a sharded parameter as ``p`` shows it."""
        evaluated, value = self._evaluate(arg)
        if evaluated:
            tensor = isinstance(value, torch.Tensor)
            self.message(describe(value, self._fsdp_models()) if tensor else pprint.pformat(value))

    def _evaluate(self, expression: str) -> tuple[bool, Any]:
        """``expression`` in the current frame, as ``p`` evaluates it; an error said as pdb says one."""
        assert self.curframe is not None  # set up at each prompt
        try:
            return True, eval(expression, self.curframe.f_globals, self.curframe_locals)
        except Exception as error:
            self.error(traceback.format_exception_only(type(error), error)[-1].strip())
            return False, None

    def displayhook(self, obj: object) -> None:
        if obj is not None:
            self.message(describe(obj, self._fsdp_models()))

    def do_units(self, arg: str) -> None:
        """units [model]: what each FSDP unit of ``model`` holds now (default: the FSDP model the frame sees)."""
        if arg:
            evaluated, model = self._evaluate(arg)
            if not evaluated:
                return
        else:
            models = self._fsdp_models()
            model = models[0] if models else None
        if not isinstance(model, nn.Module):
            self.error("units MODEL: no FSDP model in this frame or the cell's names; name one")
            return
        self.message(str(units(model)))

    def _fsdp_models(self) -> list[nn.Module]:
        """The FSDP models in sight: this frame's locals and the cell's names (a unit's forward sees only
        itself), the one with the most units first."""
        cells = [frame.f_globals for frame, _ in self.stack if frame.f_code.co_filename.startswith("<fsdp-cell-")]
        values = [*self.curframe_locals.values(), *(value for names in cells[:1] for value in names.values())]
        found = {id(v): v for v in values if isinstance(v, nn.Module)}
        counted = [(len(torch_private.fsdp_unit_states(model)), model) for model in found.values()]
        return [model for count, model in sorted(counted, key=lambda pair: -pair[0]) if count]


class _Lines:
    """pdb's stdin: each ``readline`` asks for the next line."""

    def __init__(self, next_line: Callable[[], str]) -> None:
        self._next_line = next_line

    def readline(self) -> str:
        return self._next_line()


def describe(value: object, models: Sequence[nn.Module] = ()) -> str:
    """A value as a learner wants it at a prompt: a DTensor (an FSDP2 parameter) as this rank's shard of the full
    tensor, its placement and mesh, then the shard's values; a parameter FSDP gathered for a unit of one of
    ``models`` as such, beside the shard it came from; anything else as ``repr``."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        for model in models:
            if (found := torch_private.gathered_from(model, value)) is not None:
                unit, sharded = found
                shard = tuple(torch_private.local_tensor(sharded).shape)
                return (
                    f"Parameter gathered by FSDP for unit {unit}: the full {tuple(value.shape)} on this rank while "
                    f"the unit computes (sharded, this rank holds {shard}), {value.dtype} on {value.device}\n"
                    f"{value!r}"
                )
    if isinstance(value, DTensor):
        local = torch_private.local_tensor(value)
        mesh = value.device_mesh
        over = " x ".join(str(size) for size in mesh.shape)
        kind = "Parameter" if isinstance(value, nn.Parameter) else "DTensor"
        placements = ", ".join(repr(p) for p in value.placements)  # str() is terse: S(0)
        return (
            f"{kind} sharded by FSDP: this rank holds {tuple(local.shape)} of {tuple(value.shape)} "
            f"({placements} over {over} ranks), {local.dtype} on {local.device}\nthis rank's shard: {local!r}"
        )
    return repr(value)


#: FSDP2's ``ShardedState`` and ``TrainingState`` of a unit, in words.
_SHARDED_STATES = {
    "SHARDED": "sharded",
    "UNSHARDED": "gathered (unsharded)",
    "SHARDED_POST_FORWARD": "resharded to its post-forward group",
}
_TRAINING_STATES = {"FORWARD": "in its forward", "PRE_BACKWARD": "in its backward", "POST_BACKWARD": "after backward"}


@dataclass
class UnitStates:
    """What each FSDP unit of a model holds on this rank now (``nbfsdp.units``): printed as a table."""

    rows: list[dict[str, Any]]
    model: str

    def __repr__(self) -> str:
        if not self.rows:
            return f"{self.model}: not sharded by FSDP here (no FSDP units)"
        lines = [f"FSDP units of {self.model} on this rank, now:"]
        for row in self.rows:
            state = _SHARDED_STATES.get(row["state"], row["state"].lower())
            notes = [_TRAINING_STATES[row["training"]]] if row["training"] in _TRAINING_STATES else []
            if row["all_gather_pending"]:
                notes.append("all-gather issued, not yet waited on (prefetched)")
            if row["reduce_scatter_pending"]:
                notes.append("reduce-scatter issued, not yet waited on")
            size = f"{_mib(row['local_bytes'])} of {_mib(row['full_bytes'])} here"
            lines.append(
                f"  {row['unit']}: {state}; {row['params']} parameters, {size}" + "".join(f"; {n}" for n in notes)
            )
        return "\n".join(lines)

    __str__ = __repr__


def units(model: nn.Module) -> UnitStates:
    """What each FSDP unit of ``model`` holds on this rank now: its parameters sharded or gathered, whether it is in
    its forward or backward, an all-gather issued and not yet waited on (a prefetch), a reduce-scatter not yet
    waited on. At a breakpoint inside a unit's forward (``units`` at the prompt), that unit shows gathered and the
    units whose forward is over sharded again, the root excepted (FSDP2 keeps it gathered for the backward)."""
    return UnitStates(torch_private.fsdp_unit_states(model), type(model).__name__)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


# ---------------------------------------------------------------- breakpoint() in a running cell


@dataclass
class CellPrompts:
    """One cell's breakpoints on this rank: which ranks stop, where the lines come from, how prompts go out."""

    rank: int
    stops: bool
    """This rank stops at a breakpoint (``--debug-rank``)."""
    control: str
    """The cell's control file, beside which the typed lines arrive; '' where the notebook cannot reach the rank."""
    publish: Callable[[dict[str, Any]], None]
    passed_over: str = ""
    """Why a breakpoint is passed over on this rank, said once; '' where it stops."""
    waits: bool = False
    """The cell's collectives wait for a rank at a prompt (their timeout lifted): said with each prompt."""
    sent: int = field(default=0, init=False)

    def ask(self, text: str, prompt: str, at: str) -> str:
        """Publish the output and the prompt; wait for the line typed for it."""
        self.sent += 1
        asked = self.sent
        sys.stdout.flush()  # what the cell printed before it stopped comes before the prompt
        sys.stderr.flush()
        self.publish({f"debug{asked}": {"text": text, "prompt": prompt, "at": at, "waits": self.waits}})
        path = debug_command_file(self.control, self.rank)
        try:
            while True:
                try:
                    command = json.loads(path.read_text())
                except (FileNotFoundError, ValueError):
                    command = {"seq": 0}
                if command["seq"] == asked:
                    return command["line"] + "\n"
                time.sleep(COMMAND_POLL_SECONDS)
        except KeyboardInterrupt:
            raise PromptInterrupted("interrupted at the debugger's prompt") from None

    def resumed(self, text: str, *, quit: bool) -> None:
        self.sent += 1
        self.publish({f"debug{self.sent}": {"text": text, "resumed": True, "quit": quit}})


_cell: CellPrompts | None = None


def stop_here(*_args: Any, **_kwargs: Any) -> None:
    """``sys.breakpointhook`` and ``pdb.set_trace`` on a rank: the caller's frame under a ``RankDebugger`` whose
    prompts go to the notebook, on the ranks ``--debug-rank`` chose; elsewhere nothing."""
    cell = _cell
    if cell is None or not cell.stops:
        return
    if cell.passed_over:
        print(cell.passed_over, file=sys.stderr, flush=True)
        cell.stops = False  # said once
        return
    debugger = RankDebugger(cell.rank, cell.ask)
    debugger.on_resume = cell.resumed
    caller = inspect.currentframe()
    debugger.set_trace(caller.f_back if caller is not None else None)


#: A cell that may stop at a breakpoint: its collectives' own timeout, which a rank at a prompt must not reach.
LIFTED_TIMEOUT = datetime.timedelta(days=7)


def cell_begins(rank: int, spec: CellSpec, publish: Callable[[dict[str, Any]], None]) -> None:
    """A cell starts on this rank: a ``breakpoint()`` in it prompts in the notebook, or is passed over (said why);
    where the kernel saw one, the world's collectives wait for a rank at a prompt (the kernel keeps ``--timeout``)."""
    global _cell
    passed_over = ""
    if not spec.control:
        passed_over = (
            f"nbfsdp: breakpoint() on rank {rank} passed over: this host shares no directory with the notebook, "
            "where the debugger's lines would come (%fsdp attach --shared-dir)"
        )
    elif spec.debug_ranks == []:
        passed_over = f"nbfsdp: breakpoint() on rank {rank} passed over: an --async cell has no prompt"
    stops = spec.debug_ranks is None or rank in spec.debug_ranks or bool(passed_over)
    _cell = CellPrompts(rank=rank, stops=stops, control=spec.control, publish=publish, passed_over=passed_over)
    if spec.breakpoints:
        _cell.waits = torch_private.set_collective_timeout(LIFTED_TIMEOUT)
    sys.breakpointhook = stop_here
    pdb.set_trace = stop_here  # the module function, as a cell calls it


def cell_ends(timeout: float) -> None:
    """The cell ended on this rank: breakpoints are the standard library's again, the collectives' timeout the
    world's (``timeout`` seconds)."""
    global _cell
    if _cell is not None and _cell.waits and dist.is_initialized():
        torch_private.set_collective_timeout(datetime.timedelta(seconds=timeout))
    _cell = None
    sys.breakpointhook = sys.__breakpointhook__
    pdb.set_trace = _PDB_SET_TRACE


_PDB_SET_TRACE = pdb.set_trace


# ---------------------------------------------------------------- %debug after a failed cell


@dataclass
class _Failure:
    error: BaseException
    traceback: TracebackType
    held: dict[str, int]
    """Bytes of the tensors the frames' locals hold, by device."""


_kept: _Failure | None = None
_post_mortem: RankDebugger | None = None


def keep_failure(error: BaseException) -> None:
    """Keep the frames of this rank's own failure for ``%debug``, until the next cell or ``release``."""
    global _kept
    release()
    if error.__traceback__ is not None:
        _kept = _Failure(error, error.__traceback__, _held_bytes(error.__traceback__))


def kept() -> dict[str, Any] | None:
    """What this rank keeps for ``%debug``: its error, its frames' count and the tensor bytes they hold."""
    if _kept is None:
        return None
    frames, tb = 0, _kept.traceback  # type: tuple[int, TracebackType | None]
    while tb is not None:
        frames, tb = frames + 1, tb.tb_next
    return {"error": f"{type(_kept.error).__name__}: {_kept.error}", "frames": frames, "held": dict(_kept.held)}


def release() -> dict[str, int] | None:
    """Let go of the kept frames (and a post-mortem in progress); the bytes they held, by device (None: none kept)."""
    global _kept, _post_mortem
    held = _kept.held if _kept is not None else None
    _kept = _post_mortem = None
    return held


def post_mortem_begin(rank: int) -> tuple[str, str]:
    """``%debug``: a debugger on the kept frames, at the frame that raised; what it prints first and its prompt."""
    global _post_mortem
    if _kept is None:
        raise RuntimeError("no failed frames kept on this rank")
    debugger = RankDebugger(rank)
    debugger.reset()
    debugger.setup(None, _kept.traceback)
    debugger.print_stack_entry(debugger.stack[debugger.curindex])
    _post_mortem = debugger
    return debugger.take_output(), debugger.prompt


def post_mortem_command(line: str) -> tuple[str, bool]:
    """One line typed at ``%debug``'s prompt, run as pdb's loop would; its output, and whether the debugger ended."""
    global _post_mortem
    debugger = _post_mortem
    if debugger is None:
        return "", True
    line = debugger.precmd(line)
    stop = debugger.postcmd(debugger.onecmd(line), line)
    if stop:
        _post_mortem = None
    return debugger.take_output(), bool(stop)


def _held_bytes(tb: TracebackType | None) -> dict[str, int]:
    """The bytes of the tensors the frames' locals hold (directly, in a module, or one container deep), by
    device: what keeping them costs until they are released."""
    storages: dict[tuple[str, int], int] = {}

    def add(tensor: torch.Tensor) -> None:
        tensor = torch_private.local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
        if tensor.device.type == "meta":
            return
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()

    def visit(value: object, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            add(value)
        elif isinstance(value, nn.Module):
            for tensor in [*value.parameters(), *value.buffers()]:
                add(tensor)
        elif depth == 0 and isinstance(value, (list, tuple, set)):
            for item in value:
                visit(item, 1)
        elif depth == 0 and isinstance(value, dict):
            for item in value.values():
                visit(item, 1)

    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            for value in tb.tb_frame.f_locals.values():
                visit(value, 0)
        tb = tb.tb_next
    held: dict[str, int] = {}
    for (device, _), nbytes in storages.items():
        held[device] = held.get(device, 0) + nbytes
    return held
