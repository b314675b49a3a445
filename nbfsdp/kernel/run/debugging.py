"""The debugger on the ranks, from the notebook (the kernel's side): ``breakpoint()`` prompts while a cell runs,
``%debug`` after a failed cell, ``%fsdp debug``. The ranks' side is ``nbfsdp.engines.debugging``.

- **Breakpoints**: a rank that stops publishes its prompt; ``RankPrompts`` shows one prompt at a time, the lowest
  rank first, reads the line with ``input`` (the notebook's own input box under ipykernel, as ``pdb`` in a plain
  cell gets) and writes it beside the cell's control file. A cell that may stop (``calls_debugger``) runs with its
  collectives' own timeout lifted, so a peer waiting for a rank at a prompt does not time out; the hang reporter
  (``nbfsdp.kernel.diagnostics.hang_report``) keeps ``--timeout`` instead, less the time any rank sat at a prompt.
- **``%debug``** after a failed ``%%fsdp`` cell: the failed rank kept its frames; each line typed is one
  ipyparallel call to its idle engine (``post_mortem``). IPython's own ``%debug`` answers for anything else.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.nn as nn
from IPython.core.error import UsageError

from nbfsdp.engines import debugging as rank_side
from nbfsdp.kernel.cluster.rank_calls import RankDied, RankError, RankFailed, gather, submit
from nbfsdp.shared.protocol import debug_command_file

if TYPE_CHECKING:
    import ipyparallel as ipp
    from IPython.core.interactiveshell import InteractiveShell

    from nbfsdp.kernel.run.runner import LiveView
    from nbfsdp.kernel.run.session import Session

#: The calls that stop a rank: ``breakpoint()``, ``pdb.set_trace()``.
DEBUGGER_CALLS = frozenset({"breakpoint", "set_trace"})
#: How long a first prompt waits for the prompts of ranks that stopped at the same time, so the lowest comes first.
ORDER_GRACE_SECONDS = 0.25
#: pdb's commands that quit it (``BdbQuit`` on the rank, which ends the cell).
QUIT_COMMANDS = frozenset({"q", "quit", "exit"})


class DebuggerQuit(RankError):
    """``q`` at a rank's prompt ended the cell: said in one line, not as an error's traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"nbfsdp: the cell ended at {self.label}'s debugger (q); the next cell runs on the same engines"]


def calls_debugger(code: str, values: Iterable[object]) -> bool:
    """Whether the cell, or a function or model class of the notebook's it runs, calls the debugger."""
    try:
        compiled = compile(code, "<cell>", "exec")
    except SyntaxError:  # the ranks say what is wrong with it
        return False
    if _names(compiled) & DEBUGGER_CALLS:
        return True
    return any(_names(function.__code__) & DEBUGGER_CALLS for function in _notebook_functions(values))


def _names(code: Any) -> set[str]:
    """The global and attribute names a code object and those nested in it use."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _names(constant)
    return names


def _notebook_functions(values: Iterable[object]) -> list[Any]:
    """The functions defined in the notebook among ``values``, and the methods of the notebook's classes they
    are or hold (a model's modules)."""
    classes: set[type] = set()
    functions: list[Any] = []
    for value in values:
        if callable(value) and hasattr(value, "__code__") and getattr(value, "__module__", "") == "__main__":
            functions.append(value)
        elif isinstance(value, nn.Module):
            classes |= {type(module) for module in value.modules()}
        elif isinstance(value, type):
            classes.add(value)
    for cls in classes:
        if cls.__module__ == "__main__":
            functions += [f for f in vars(cls).values() if hasattr(f, "__code__")]
    return functions


def debug_ranks(given: str | None, world_size: int) -> list[int] | None:
    """``--debug-rank``: the ranks a breakpoint stops (``1``, ``0,2``), checked against the world; None, every rank."""
    if given is None:
        return None
    try:
        ranks = sorted({int(part) for part in given.split(",")})
    except ValueError:
        raise UsageError(f"--debug-rank {given}: a rank or ranks separated by commas, such as 1 or 0,2") from None
    if outside := [rank for rank in ranks if not 0 <= rank < world_size]:
        raise UsageError(
            f"--debug-rank {given}: no rank {outside[0]} at --world-size {world_size} (the ranks are 0 to "
            f"{world_size - 1})"
        )
    return ranks


_NOT_WAITING = (
    "nbfsdp: the other ranks' collectives do not wait for this prompt: they time out after --timeout (nbfsdp "
    "lifts their timeout where it sees breakpoint() or pdb.set_trace() in the cell or the notebook code it runs, "
    "from torch 2.7)"
)


class RankPrompts:
    """A running cell's ranks stopped at a breakpoint: each prompt shown in the notebook, one at a time, the
    lowest rank first; the line typed sent to that rank. Knows since when a rank has been stopped, for the
    collectives' timeout and the hang report, which wait for it, and marks the stopped rank on the dashboard."""

    def __init__(self, results: list[ipp.AsyncResult], control: str) -> None:
        self._results, self._control = results, control
        self._next = [1] * len(results)  # the next debug<n> message of each rank
        self._waiting: dict[int, tuple[int, str, float]] = {}  # rank -> (its prompt's number, prompt, seen at)
        self._stopped: set[int] = set()
        self._lock = threading.Lock()
        self._since: float | None = None  # since when some rank is stopped (time.time(), as the ranks' clocks)
        self._past: list[tuple[float, float]] = []  # earlier spans in which some rank was stopped
        self.view: LiveView | None = None
        self._warned = False
        #: The rank sent pdb's ``q``: the cell ends because of it, whichever rank's failure the kernel sees first
        #: (its peers' collectives break when it tears its process group down, and may report before it does).
        self.quit_by: int | None = None

    def pump(self) -> None:
        """Take what the ranks published since the last look: output, prompts, resumptions."""
        for rank, result in enumerate(self._results):
            data = result.data
            while (message := data.get(f"debug{self._next[rank]}")) is not None:
                number = self._next[rank]
                self._next[rank] += 1
                if message["text"]:
                    sys.stdout.write(message["text"])
                    sys.stdout.flush()
                if message.get("resumed"):
                    self._resumed(rank)
                else:
                    self._waiting[rank] = (number, message["prompt"], time.monotonic())
                    if not message["waits"] and not self._warned:
                        self._warned = True
                        print(_NOT_WAITING, file=sys.stderr, flush=True)
                    self._stop(rank, message["at"])

    def serve(self) -> None:
        """Show the lowest stopped rank's prompt and send it the line typed (``input``: interruptible)."""
        if not self._waiting or time.monotonic() - min(t for _, _, t in self._waiting.values()) < ORDER_GRACE_SECONDS:
            return
        rank = min(self._waiting)
        number, prompt, _ = self._waiting.pop(rank)
        line = input(prompt)
        if line.strip() in QUIT_COMMANDS:
            self.quit_by = rank
        path = debug_command_file(self._control, rank)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(json.dumps({"seq": number, "line": line}))
        partial.replace(path)  # a rank never reads half a line

    def stopped_now(self) -> bool:
        with self._lock:
            return bool(self._stopped)

    def stopped_seconds_since(self, since: float) -> float:
        """Seconds since ``since`` (``time.time()``) during which some rank sat at a prompt."""
        with self._lock:
            spans = [*self._past, *([(self._since, time.time())] if self._since is not None else [])]
        return sum(max(0.0, end - max(start, since)) for start, end in spans)

    def _stop(self, rank: int, at: str) -> None:
        with self._lock:
            self._stopped.add(rank)
            if self._since is None:
                self._since = time.time()
        if self.view is not None:
            self.view.rank_state(rank, f"stopped at a breakpoint ({_short(at)}): the prompt is below the cell")
            self.view.refresh()

    def _resumed(self, rank: int) -> None:
        with self._lock:
            self._stopped.discard(rank)
            if not self._stopped and self._since is not None:
                self._past.append((self._since, time.time()))
                self._since = None
        if self.view is not None:
            self.view.rank_state(rank, "running")


def _short(at: str) -> str:
    """``<fsdp-cell-3>:4 in <module>`` as ``cell line 4``; a library's line as ``file.py:12 in f``."""
    filename, _, rest = at.partition(":")
    if filename.startswith("<fsdp-cell-"):
        return f"cell line {rest.split(' ')[0]}"
    return f"{Path(filename).name}:{rest}"


# ---------------------------------------------------------------- %debug after a failed cell


def post_mortem(session: Session, rank: int | None = None, error: BaseException | None = None) -> None:
    """``%debug`` on rank ``rank``'s failed frames (default: the rank the cell's error names), in the notebook."""
    kept = _kept_frames(session)
    failed = sorted(r for r, frames in kept.items() if frames)
    if not failed:
        raise UsageError(
            "no rank keeps a failed cell's frames: %debug walks them after a %%fsdp cell that failed, until the next "
            "cell (or %fsdp debug --release)"
        )
    if rank is None:
        rank = error.rank if isinstance(error, RankError) and error.rank in failed else failed[0]
    if rank not in kept:
        raise UsageError(f"--rank {rank}: no such rank running (the failed ranks: {', '.join(map(str, failed))})")
    if rank not in failed:
        raise UsageError(
            f"rank {rank} did not fail on its own (its error, if any, followed another rank's): no frames to walk. "
            f"The ranks that failed: {', '.join(map(str, failed))} (%fsdp debug --rank R)"
        )
    frames = kept[rank]
    assert frames is not None
    others = [str(r) for r in failed if r != rank]
    print(
        f"nbfsdp: rank {rank}'s frames ({frames['error']}); they hold {_held(frames['held'])} until the next cell or "
        f"%fsdp debug --release"
        + (f"; also failed: rank {', '.join(others)} (%fsdp debug --rank R)" if others else "")
        + "; q ends"
    )
    text, prompt = _on_rank(session, rank, rank_side.post_mortem_begin, rank)
    print(text, end="")
    done = False
    while not done:
        text, done = _on_rank(session, rank, rank_side.post_mortem_command, input(prompt))
        print(text, end="")


def release(session: Session) -> str:
    """``%fsdp debug --release``: every rank lets go of its failed frames; what that freed, said."""
    freed = {rank: held for rank, held in _on_every_rank(session, rank_side.release).items() if held is not None}
    if not freed:
        return "nbfsdp: no rank kept a failed cell's frames"
    return "nbfsdp: released the failed frames: " + "; ".join(f"rank {r}: {_held(h)}" for r, h in freed.items())


def which_failed(session: Session) -> str:
    """``%fsdp debug``: the ranks that keep a failed cell's frames, with their errors."""
    kept = _kept_frames(session)
    failed = {rank: frames for rank, frames in kept.items() if frames}
    if not failed:
        return "nbfsdp: no rank keeps a failed cell's frames (%debug walks them after a failed %%fsdp cell)"
    lines = [f"rank {rank}: {frames['error']} ({_held(frames['held'])} held)" for rank, frames in failed.items()]
    return "nbfsdp: failed frames kept, for %debug (or %fsdp debug --rank R):\n  " + "\n  ".join(lines)


def _held(held: dict[str, int]) -> str:
    if not held:
        return "no tensors"
    return ", ".join(f"{_size(nbytes)} of tensors on {device}" for device, nbytes in held.items())


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def _kept_frames(session: Session) -> dict[int, dict[str, Any] | None]:
    return _on_every_rank(session, rank_side.kept)


def _on_every_rank(session: Session, function: Callable[..., Any]) -> dict[int, Any]:
    """``function()`` on each rank of the world whose engine still runs (a killed one kept nothing), by rank."""
    world, cluster = session.cluster.world, session.cluster
    if world is None:
        return {}
    dead = cluster.dead_ranks()
    engine_ids = {rank: engine_id for rank, engine_id in enumerate(world.engine_ids) if rank not in dead}
    try:
        return gather(submit(cluster.client, engine_ids, function, dict.fromkeys(engine_ids, ())), cluster.dead_ranks)
    except (RankDied, RankFailed) as error:
        raise UsageError(f"nbfsdp: the ranks' frames cannot be reached: {error}") from None


def _on_rank(session: Session, rank: int, function: Callable[..., Any], *args: Any) -> Any:
    world = session.cluster.world
    assert world is not None  # _kept_frames found the rank in it
    try:
        results = submit(session.cluster.client, {rank: world.engine_ids[rank]}, function, {rank: args})
        return gather(results, session.cluster.dead_ranks)[rank]
    except (RankDied, RankFailed) as error:
        raise UsageError(f"nbfsdp: rank {rank}'s debugger ended: {error}") from None


# ---------------------------------------------------------------- IPython's %debug, taught the ranks


class DebugMagic:
    """``%debug`` after a failed ``%%fsdp`` cell opens the failed rank's frames; after anything else, or with
    arguments, it is IPython's own ``%debug`` (kept, and put back by ``remove``)."""

    def __init__(self, shell: InteractiveShell, session: Session) -> None:
        self._shell, self._session = shell, session
        manager = shell.magics_manager
        find = getattr(manager, "find", None)  # IPython 9 registers %debug lazily (a LazyMagic that finds us)
        self._original = find("line", "debug") if find is not None else manager.magics["line"].get("debug")
        shell.register_magic_function(self.debug, "line", "debug")  # type: ignore[arg-type]  # as extension.py

    def debug(self, line: str = "") -> Any:
        """%debug: after a failed %%fsdp cell, the failed rank's own frames; otherwise IPython's %debug."""
        error = getattr(sys, "last_value", None)
        if not line.strip() and isinstance(error, RankError) and self._session.cluster.world is not None:
            post_mortem(self._session, error=error)
            return None
        if self._original is not None:
            return self._original(line)
        return None

    def remove(self) -> None:
        if self._original is not None:
            self._shell.magics_manager.magics["line"]["debug"] = self._original
        else:
            self._shell.magics_manager.magics["line"].pop("debug", None)
