"""One function run on every rank at once, its results by rank, a death or a failure seen at once.

``AsyncResult.get()`` on all engines would wait for the slowest one, and a rank
whose engine died never answers: its peers wait in a collective until a
timeout. Here each rank's result is waited for in short slices, and between
slices the cluster is asked which engines ended, so a death ends the wait
within ``LIVENESS_SECONDS``. The world's set-up, the models' delivery, a
checkpoint's save and load and a cell's run (``nbfsdp.kernel.run.runner``,
which also streams output while it waits) all go through ``submit`` and ``gather`` here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ipyparallel import error as ipp_error

from nbfsdp.kernel.cluster.world import ENGINE_START_TIMEOUT, wait_for_death

if TYPE_CHECKING:
    import ipyparallel as ipp

#: How often a wait asks the cluster whether a rank's engine ended.
LIVENESS_SECONDS = 0.25
#: A rank whose call failed because its engine went: how long its death may take to be seen.
DEATH_SECONDS = 2.0


class RankError(Exception):
    """A rank failed; shows that rank's traceback, not the client's."""

    def __init__(
        self, rank: int, message: str, remote_traceback: str = "", others: str = "", host: str | None = None
    ) -> None:
        self.label = f"rank {rank}" if host is None else f"rank {rank} on {host}"
        super().__init__(f"{self.label}: {message}{f' ({others})' if others else ''}")
        self.rank, self.host = rank, host
        self.remote_traceback = remote_traceback
        self.debuggable = False
        """The rank keeps its failed frames: ``%debug`` walks them (``nbfsdp.kernel.run.debugging``)."""

    def _render_traceback_(self) -> list[str]:
        lines = [f"[{self.label}] {line}" for line in self.remote_traceback.rstrip().splitlines()]
        hint = [f"nbfsdp: %debug walks {self.label}'s own frames, until the next cell"] if self.debuggable else []
        return [*lines, f"RankError: {self}", *hint]


class RankOutOfMemory(RankError):
    """A rank ran out of memory (CUDA's allocator, or ``--memory-limit``): ``memories`` holds each failed
    rank's bytes where it stopped (``CellOutcome.memory``); once ``report`` is written (the planner's view
    beside them, ``nbfsdp.kernel.diagnostics.out_of_memory``) it is what the notebook shows, with the cell's line."""

    def __init__(
        self,
        rank: int,
        message: str,
        remote_traceback: str,
        others: str,
        host: str | None,
        memories: dict[int, dict[str, Any]],
    ) -> None:
        super().__init__(rank, message, remote_traceback, others, host)
        self.memories = memories
        self.report = ""

    def _render_traceback_(self) -> list[str]:
        if not self.report:
            return super()._render_traceback_()
        cell = [line for line in self.remote_traceback.splitlines() if '"<fsdp-cell-' in line]
        shown = self.remote_traceback.splitlines()
        lines = [*shown[: shown.index(cell[-1]) + 2]] if cell else []  # the cell's frames, not torch's
        return [*(f"[{self.label}] {line}" for line in lines), self.report, f"OutOfMemoryError: {self}"]


class RankDied(Exception):
    """Rank ``rank``'s engine ended while the call ran: ``how`` says how (the cluster's word)."""

    def __init__(self, rank: int, how: str) -> None:
        super().__init__(f"rank {rank}: {how}")
        self.rank, self.how = rank, how


class RankFailed(Exception):
    """Rank ``rank``'s call raised ``error`` (ipyparallel's ``RemoteError``: ``ename``, ``evalue``)."""

    def __init__(self, rank: int, error: ipp_error.RemoteError) -> None:
        super().__init__(f"rank {rank}: {error.ename}: {error.evalue}")
        self.rank, self.error = rank, error
        self.ename: str = error.ename
        self.evalue: str = error.evalue


def submit(
    client: ipp.Client,
    engine_ids: Mapping[int, int],
    function: Callable[..., Any],
    arguments: Mapping[int, tuple],
) -> dict[int, ipp.AsyncResult]:
    """``function(*arguments[rank])`` sent at once to each rank of ``engine_ids`` (rank -> engine id); else
    ``RankDied`` for the first rank whose engine the controller no longer has (it saw the engine die: ipyparallel
    would raise ``IndexError('No such engine')``). The client's IO thread drops an engine the moment the
    controller reports its end, so a rank checked can still be gone at its send: every lookup is a check, the
    views made first (none sent where one is gone already) and each send too (the ranks before it were sent to
    then, for a world that is being replaced)."""
    gone = "its engine ({}) is gone: the controller saw it end"
    views = {}
    for rank, engine_id in engine_ids.items():
        try:
            views[rank] = client[engine_id]
        except IndexError:
            raise RankDied(rank, gone.format(engine_id)) from None
    sent = {}
    for rank, view in views.items():
        try:
            sent[rank] = view.apply_async(function, *arguments[rank])
        except IndexError:  # ipyparallel looks the engine up again as it sends
            raise RankDied(rank, gone.format(engine_ids[rank])) from None
    return sent


def gather(
    results: Mapping[int, ipp.AsyncResult],
    dead_ranks: Callable[[], dict[int, str]],
    *,
    deadline: float | None = None,
) -> dict[int, Any]:
    """Every rank's answer, by rank; else ``RankDied`` for a rank whose engine ended (a death is the cause
    even where a peer failed first: its peers fail because of it), ``RankFailed`` for the lowest failed rank,
    or ipyparallel's ``TimeoutError`` past ``deadline`` (``time.monotonic()``)."""
    for rank, result in results.items():
        while not result.ready():
            if deadline is not None and time.monotonic() >= deadline:
                raise ipp_error.TimeoutError(f"rank {rank} did not answer in time")
            result.wait(LIVENESS_SECONDS)
            if not result.ready() and (dead := dead_ranks()):
                raise RankDied(*next(iter(dead.items())))
    answers = {}
    for rank, result in results.items():
        try:
            answers[rank] = result.get()
        except (ipp_error.RemoteError, ipp_error.EngineError) as error:
            # the controller may report the death first, as an EngineError (raised, or remote)
            lost = isinstance(error, ipp_error.EngineError) or getattr(error, "ename", "") == "EngineError"
            if how := wait_for_death(dead_ranks, rank, DEATH_SECONDS if lost else 0.0):
                raise RankDied(rank, how) from None
            if dead := dead_ranks():
                raise RankDied(*next(iter(dead.items()))) from None
            if lost:
                raise RankDied(rank, "it stopped answering") from None
            raise RankFailed(rank, error) from None
    return answers


def set_up_every_rank(
    client: ipp.Client,
    engine_ids: Mapping[int, int],
    setup: Callable[..., Any],
    arguments: Mapping[int, tuple],
) -> dict[int, Any]:
    """``setup(*arguments[rank])`` on each rank's engine (a new world's process group, an
    engine's check-in), within ``ENGINE_START_TIMEOUT``, an engine that leaves the controller meanwhile named
    at once. A failed set-up raises its ``RemoteError`` as ipyparallel gives it."""

    def left() -> dict[int, str]:
        registered = set(client.ids)
        return {
            rank: f"engine {engine_id} left the controller while it was being set up"
            for rank, engine_id in engine_ids.items()
            if engine_id not in registered
        }

    try:
        results = submit(client, engine_ids, setup, arguments)
        return gather(results, left, deadline=time.monotonic() + ENGINE_START_TIMEOUT)
    except RankDied as died:
        raise RankError(died.rank, died.how) from None
    except RankFailed as failed:
        raise failed.error from None
