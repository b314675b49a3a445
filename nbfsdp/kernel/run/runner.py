"""Run one cell on every rank: submit, stream output, watch each rank, end cleanly.

``AsyncResult.get()`` on all engines would wait for the slowest rank, so one
failing rank would hang the cell while the others wait in a collective
(ipyparallel's ``%%px`` does). Here each rank's result is watched on its own;
the first failure ends the cell. Its rank has already torn down its process
group, which wakes peers blocked in gloo or NCCL within a second; a peer that
is not in a collective gets SIGINT, and one that still does not return is
killed, its world restarted by the next cell.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import ipyparallel as ipp
import torch
from IPython import get_ipython
from IPython.display import DisplayHandle, display

from nbfsdp.engines import engine
from nbfsdp.kernel.cluster.rank_calls import LIVENESS_SECONDS, RankDied, RankError, RankOutOfMemory, submit
from nbfsdp.kernel.cluster.world import Cluster
from nbfsdp.kernel.run.debugging import DebuggerQuit, RankPrompts
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.protocol import BAR_MARKER, BarDrawing, CellOutcome, CellSpec

#: How often a running cell's output, records and widget events are looked at (a rank's end wakes it at once).
POLL_SECONDS = 0.1
#: After a failure: how long peers get to fail on their own, then after SIGINT.
PEER_GRACE_SECONDS = 0.5
INTERRUPT_GRACE_SECONDS = 1.5
#: How long the ranks still running are left to end on their own after a rank's ``q`` at its prompt.
QUIT_GRACE_SECONDS = 5.0
#: Over several hosts, once an engine was lost: how much longer the other ranks of its host are watched for their
#: engines' end too.
HOST_DEATH_SECONDS = 3.0


#: What PyTorch says when a low-precision model output meets an fp32 tensor in an op that needs one dtype
#: (``mse_loss``'s backward, ``addmm``...).
_DTYPE_MISMATCH = re.compile(
    r"expected (?:scalar type |dtype )?(?:BFloat16|Half)"
    r"|(?:BFloat16|Half) (?:and|!=) Float|Float (?:and|!=) (?:BFloat16|Half)"
)


def low_precision_hint(error: str, config: FSDPConfig) -> str:
    """What to do, where a rank failed on fp32 meeting the low precision its model computes in (under
    DEFAULT on GPU by default): FSDP2 leaves the model's output in ``param_dtype``."""
    compute = config.dtypes()[0]
    if compute in (torch.float32, None) or not _DTYPE_MISMATCH.search(error):  # None: as the model stores it
        return ""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute, str(compute))
    return (
        f"; under mixed precision {config.mixed_precision} the model computes in {name} and its output stays "
        f"{name}: compute the loss in fp32 (loss_fn(model(x).float(), y)) or under torch.autocast, or run the "
        "cell with --mixed-precision FULL"
    )


class OutputSink(Protocol):
    """Where ranks' output goes: the cell's own streams, or a widget for a background run."""

    def write(self, text: str, *, stderr: bool) -> None: ...

    def progress(self, bar: str, text: str, *, ended: bool) -> None:
        """Rank 0's progress bar ``bar`` now reads ``text`` (``nbfsdp.engines.progress``); ``ended``: its last state."""


class CellStreams:
    """The running cell's stdout and stderr; each progress bar in a display of its own, updated in place
    (a terminal IPython, which cannot update one, prints a bar once, when it ends)."""

    def __init__(self) -> None:
        self._in_kernel = getattr(get_ipython(), "kernel", None) is not None
        self._bars: dict[str, DisplayHandle] = {}

    def write(self, text: str, *, stderr: bool) -> None:
        stream = sys.stderr if stderr else sys.stdout
        stream.write(text)
        stream.flush()

    def progress(self, bar: str, text: str, *, ended: bool) -> None:
        if not self._in_kernel:
            if ended and text:
                self.write(f"{text}\n", stderr=True)
        elif bar in self._bars:
            self._bars[bar].update({"text/plain": text}, raw=True)
        elif text:  # a bar that ends unseen and leaves nothing (leave=False) needs no display
            self._bars[bar] = display({"text/plain": text}, raw=True, display_id=True)


#: What the profiler prints on a rank each time a step is captured (``--timeline``): Kineto's start and stop
#: (printed whatever its log level) and the CPU allocator's note on freeing a tensor allocated before it began.
#: Not the cell's output: left out of it where the cell captures steps.
PROFILER_NOISE = re.compile(
    r"SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)"
    r"|Memory block of unknown size was allocated before the profiling started"
)


class _OutputStreamer:
    """Writes each rank's stdout and stderr as they grow, one prefixed line at a time; rank 0's progress
    bars go to the sink's ``progress``, each bar's latest state once a look (other ranks draw none).
    ``quiet``: the profiler's own lines are left out (a cell that captures steps)."""

    def __init__(self, results: list[ipp.AsyncResult], sink: OutputSink, *, quiet: bool = False) -> None:
        self._results = results
        self._sink = sink
        self._quiet = quiet
        self._sent = {(rank, name): 0 for rank in range(len(results)) for name in ("stdout", "stderr")}
        self._bars: dict[str, tuple[str, bool]] = {}  # id -> the text last shown, whether it ended

    def pump(self, *, final: bool = False) -> None:
        bars: dict[str, tuple[str, bool]] = {}
        for rank, result in enumerate(self._results):
            for name in ("stdout", "stderr"):
                text = result.metadata[name]
                start = self._sent[rank, name]
                end = len(text) if final else text.rfind("\n", start) + 1
                if end > start:
                    lines = []
                    for line in text[start:end].splitlines():
                        if self._quiet and PROFILER_NOISE.search(line):
                            continue
                        before, marker, drawn = line.partition(BAR_MARKER)
                        if before or not marker:
                            lines.append(f"[rank {rank}] {before}\n")
                        if marker and rank == 0 and (drawing := BarDrawing.parse(drawn)):
                            bars[drawing.bar] = (drawing.text, drawing.ended)
                    if lines:
                        self._sink.write("".join(lines), stderr=name == "stderr")
                    self._sent[rank, name] = end
        if final:  # a bar the cell left open (an error, a break) ends in its last state
            bars = {bar: (text, True) for bar, (text, _) in (self._bars | bars).items()}
        for bar, state in bars.items():
            if self._bars.get(bar) != state:
                self._bars[bar] = state
                self._sink.progress(bar, state[0], ended=state[1])


def _outcome(result: ipp.AsyncResult) -> CellOutcome:
    try:
        return result.get(0)
    except ipp.RemoteError as error:  # raised outside run_cell's own handler
        lost = error.ename == "EngineError"  # the engine went away under the task
        # otherwise the client's own interrupt reached the rank outside run_cell
        return CellOutcome.failed(f"{error.ename}: {error.evalue}", secondary=not lost, engine_lost=lost)


class LiveView(Protocol):
    """What shows a cell while it runs (the dashboard): redrawn as records arrive, told of dead ranks."""

    def refresh(self, *, final: bool = False) -> None: ...
    def rank_state(self, rank: int, state: str) -> None: ...


class _RecordStream:
    """What each rank has published since the last look, by key: ``records<n>`` (its records) to
    ``on_records``, ``timeline<n>`` (a captured step: ``nbfsdp.engines.timeline``) to ``on_capture``,
    ``first_call`` (rank 0's model's first call, its shapes: ``nbfsdp.engines.memory_limit``) to ``on_first_call``."""

    def __init__(
        self,
        results: list[ipp.AsyncResult],
        view: LiveView | None,
        handlers: dict[str, Callable[[Any], None] | None],
    ) -> None:
        self._results, self._view = results, view
        self._handlers = {prefix: handler for prefix, handler in handlers.items() if handler is not None}
        self._seen: list[set[str]] = [set() for _ in results]

    def pump(self) -> None:
        if self._handlers:
            for result, seen in zip(self._results, self._seen, strict=True):
                data = result.data  # ipyparallel's client thread adds to it as the ranks publish
                for key in [k for k in tuple(data) if k not in seen]:  # tuple(): copied at once, under the GIL
                    seen.add(key)
                    handler = next((h for prefix, h in self._handlers.items() if key.startswith(prefix)), None)
                    if handler is not None:
                        handler(data[key])
        if self._view is not None:
            self._view.refresh()


class RankRun:
    """One cell submitted to every rank; ``watch`` follows it to its end, here or in a background thread.

    ``skeletons`` are the models sent anew (their shards were delivered already). The ranks start at once;
    ``show_on`` then says where their output and records go (the dashboard is built while they run).
    """

    def __init__(self, cluster: Cluster, spec: CellSpec, values: bytes, skeletons: dict[str, bytes]) -> None:
        self.cluster = cluster
        world = cluster.world
        assert world is not None, "no world running"  # the session ensured the cell's world before the run
        self.world = world
        self.config = spec.fsdp
        engine_ids = dict(enumerate(self.world.engine_ids))
        arguments = dict.fromkeys(engine_ids, (spec, values, skeletons))
        try:
            self.results = list(submit(cluster.client, engine_ids, engine.run_cell, arguments).values())
        except RankDied as died:  # an engine ended since the world was checked: the next cell starts a new one
            world.broken = True
            raise RankError(died.rank, f"engine died before the cell started: {died.how}") from None
        self.view: LiveView | None = None
        self._captures = spec.timeline > 0
        self._streamer = _OutputStreamer(self.results, CellStreams(), quiet=self._captures)
        self._records = _RecordStream(self.results, None, {})
        self._interrupt = threading.Event()
        self.prompts = RankPrompts(self.results, spec.control)
        self._timed_out: RankError | None = None

    def show_on(
        self,
        view: LiveView | None = None,
        sink: OutputSink | None = None,
        on_records: Callable[[list[dict[str, Any]]], None] | None = None,
        on_capture: Callable[[dict[str, Any]], None] | None = None,
        on_first_call: Callable[[Any], None] | None = None,
    ) -> None:
        """Before ``watch``: ``view`` redrawn as records arrive and told of dead ranks, the ranks' output into
        ``sink`` (default: the cell's own streams), each batch of records they stream to ``on_records``, each
        step a rank captured (``--timeline``) to ``on_capture``, the shapes of rank 0's model's first call to
        ``on_first_call``."""
        self.view = self.prompts.view = view
        self._streamer = _OutputStreamer(self.results, sink or CellStreams(), quiet=self._captures)
        handlers = {"records": on_records, "timeline": on_capture, "first_call": on_first_call}
        self._records = _RecordStream(self.results, view, handlers)

    def stop(self) -> None:
        """End every rank now (SIGINT, then a kill for one that does not stop), as an interrupt of ``watch``
        does; the next cell starts a fresh world if one died."""
        self.world.broken = True
        _stop_ranks(self, {}, immediately=True)

    def interrupt(self) -> None:
        """From another thread: end the run as a KeyboardInterrupt in ``watch`` would."""
        self._interrupt.set()

    def time_out(self, rank: int, message: str) -> None:
        """From another thread: ``rank`` waited in a collective past ``--timeout`` in a cell whose collectives have
        no timeout of their own (they wait for a rank at a prompt): the run ends with that error."""
        self._timed_out = RankError(rank, message)
        self._interrupt.set()

    def watch(self, on_poll: Callable[[], None] | None = None) -> list[CellOutcome]:
        """Each rank's outcome, or ``RankError``; KeyboardInterrupt interrupts every rank, kills those
        that do not stop, and propagates. ``on_poll`` runs between looks (the notebook's widget events)."""
        outcomes: dict[int, CellOutcome] = {}
        try:
            _watch(self, outcomes, on_poll)
        except KeyboardInterrupt:
            self.world.broken = True
            _stop_ranks(self, outcomes, immediately=True)
            if self._timed_out is not None:
                raise self._timed_out from None
            raise
        finally:
            for result in self.results:
                if result.ready():
                    result.wait_for_output(1.0)
            self._streamer.pump(final=True)
        failed = {rank: o for rank, o in outcomes.items() if not o.ok}
        if failed:
            self.world.broken = True
            quit_by = next((rank for rank, o in sorted(failed.items()) if o.quit_debugger), self.prompts.quit_by)
            if quit_by is not None:
                raise DebuggerQuit(quit_by, "q at the debugger's prompt")
            if any(o.engine_lost for o in failed.values()):
                _see_deaths(self, outcomes)  # a rank that failed because a peer died, and died too, is named lost
                failed = {rank: o for rank, o in outcomes.items() if not o.ok}
            # a rank whose engine ended is the cause; its peers' errors (a closed connection) follow from it
            primary = (
                {rank: o for rank, o in failed.items() if o.engine_lost}
                or {rank: o for rank, o in failed.items() if not o.secondary}
                or failed
            )
            rank = min(primary)
            message = primary[rank].error + low_precision_hint(primary[rank].error, self.config)
            same = [str(r) for r in sorted(primary) if r != rank and primary[r].error == message]
            others = [f"rank {r}: {o.error}" for r, o in primary.items() if r != rank and o.error != message]
            if same:
                others.insert(0, f"also on ranks {', '.join(same)}")
            hosts = [info.host for info in self.world.engines]
            host = hosts[rank] if len(set(hosts)) > 1 else None  # named where the world spans hosts
            memories = {r: o.memory for r, o in sorted(failed.items()) if o.memory is not None}
            if any(memory.get("out_of_memory") for memory in memories.values()):
                raise RankOutOfMemory(rank, message, primary[rank].traceback, "; ".join(others), host, memories)
            error = RankError(rank, message, primary[rank].traceback, "; ".join(others), host)
            error.debuggable = primary[rank].kept_frames
            raise error
        return [outcomes[rank] for rank in range(len(self.results))]


def _watch(run: RankRun, outcomes: dict[int, CellOutcome], on_poll: Callable[[], None] | None) -> None:
    next_liveness = time.monotonic() + LIVENESS_SECONDS
    results, cluster = run.results, run.cluster
    while len(outcomes) < len(results):
        if run._interrupt.is_set():
            raise KeyboardInterrupt
        for rank, result in enumerate(results):
            if rank not in outcomes and result.ready():
                outcomes[rank] = _outcome(result)
                if outcomes[rank].engine_lost and (how := cluster.how_rank_died(rank)):
                    outcomes[rank] = dataclasses.replace(outcomes[rank], error=f"engine died: {how}")
        run._streamer.pump()
        run._records.pump()
        run.prompts.pump()
        run.prompts.serve()  # a rank stopped at a breakpoint: its prompt, here, until a line is typed
        if time.monotonic() >= next_liveness:
            for rank, how in cluster.dead_ranks().items():
                outcomes.setdefault(rank, CellOutcome.failed(f"engine died: {how}", engine_lost=True))
                if run.view is not None:
                    run.view.rank_state(rank, f"dead: {how}")
            next_liveness = time.monotonic() + LIVENESS_SECONDS
        if any(not o.ok for o in outcomes.values()) and len(outcomes) < len(results):
            _stop_ranks(run, outcomes, immediately=False)
            return
        if on_poll is not None:
            on_poll()
        # woken at once by a rank's result, so the cell ends as soon as the last rank does
        pending = [result for rank, result in enumerate(results) if rank not in outcomes]
        concurrent.futures.wait(pending, timeout=POLL_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)


def _see_deaths(run: RankRun, outcomes: dict[int, CellOutcome]) -> None:
    """Name the ranks whose engine ended while the others were being stopped, also one that failed first (its
    peer's death broke its collective) and then went. Over several hosts, where an engine was lost the rest of
    its host likely went with it: those ranks are watched a little longer (a busy controller sees a host's
    engines go seconds apart), so each is named as lost rather than as a rank that failed or did not stop."""
    hosts = [info.host for info in run.world.engines]
    deadline = time.monotonic() + HOST_DEATH_SECONDS
    while True:
        for rank, how in run.cluster.dead_ranks().items():
            if not _lost(outcomes, rank):
                outcomes[rank] = CellOutcome.failed(f"engine died: {how}", engine_lost=True)
        lost = {hosts[rank] for rank in outcomes if _lost(outcomes, rank)}
        waiting = [rank for rank, host in enumerate(hosts) if host in lost and not _lost(outcomes, rank)]
        if len(set(hosts)) == 1 or not waiting or time.monotonic() >= deadline:
            return
        time.sleep(POLL_SECONDS)


def _lost(outcomes: dict[int, CellOutcome], rank: int) -> bool:
    return (outcome := outcomes.get(rank)) is not None and outcome.engine_lost


def _stop_ranks(run: RankRun, outcomes: dict[int, CellOutcome], *, immediately: bool) -> None:
    """Bring every rank still running to an end: grace, then SIGINT, then kill."""
    results, cluster = run.results, run.cluster
    steps: list[tuple[signal.Signals | None, float]] = [(signal.SIGINT, INTERRUPT_GRACE_SECONDS)]
    if not immediately:  # a rank that quit its debugger is ending on its own: interrupting it would lose its q
        steps.insert(0, (None, QUIT_GRACE_SECONDS if run.prompts.quit_by is not None else PEER_GRACE_SECONDS))
    for signum, grace in steps:
        running = [rank for rank in range(len(results)) if rank not in outcomes]
        if not running:
            return
        if signum is not None:
            cluster.signal_ranks(running, signum)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(not results[r].ready() for r in running):
            run._streamer.pump()
            time.sleep(POLL_SECONDS)
        for rank in running:
            if results[rank].ready():
                outcomes[rank] = _outcome(results[rank])
    _see_deaths(run, outcomes)
    stuck = [rank for rank in range(len(results)) if rank not in outcomes]
    for rank in stuck:
        outcomes[rank] = CellOutcome.failed("did not stop; engine killed", secondary=True)
    if stuck:
        cluster.kill_engines()
