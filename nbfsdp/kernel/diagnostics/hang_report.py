"""A hang reported by itself: while a cell runs, the kernel asks the ranks where they are (``%fsdp where``'s
machinery, ``nbfsdp.kernel.diagnostics.where``) and, once a rank has waited in one collective longer than
``--hang-report`` seconds, prints that report once, as the user would have asked for it. The cell goes on
waiting for ``--timeout`` or an interrupt: the report only says where it is stuck and why. The cell's live
dashboard marks the ranks it names, in their rows: the stuck one ("stuck in all_reduce #1 for 17 s at cell line
4") and the one that left it waiting.

No rank is asked before ``seconds`` have passed (none can have waited that long), then once a second: each
ask costs every rank's watcher thread one stack and ledger written to a file, about a millisecond. Runs in the
kernel, on a thread of its own.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from nbfsdp.kernel.diagnostics.where import RankPosition, Where
from nbfsdp.ui.dashboard import LiveDashboard

if TYPE_CHECKING:
    from nbfsdp.kernel.run.debugging import RankPrompts

#: How often the ranks are asked once a hang is possible.
ASK_EVERY_SECONDS = 1.0


class HangReporter:
    """Watches one running cell and reports, once, a rank that has waited in a collective too long.

    In a cell whose collectives wait for a rank at a debugger prompt (their own timeout lifted,
    ``nbfsdp.kernel.run.debugging``) it also keeps ``--timeout``: ``timeout`` and ``on_timeout`` given, a rank that
    has waited in one collective longer than it, less the time any rank sat at a prompt meanwhile, ends the cell
    through ``on_timeout(rank, message)``.
    """

    def __init__(
        self,
        ask: Callable[[], Where],
        seconds: float,
        dashboard: LiveDashboard | None = None,
        prompts: RankPrompts | None = None,
        timeout: tuple[float, Callable[[int, str], None]] | None = None,
    ) -> None:
        """``seconds``: 0 reports nothing. ``prompts``: the cell's ranks stopped at a breakpoint; a rank at a
        prompt is not a hang, and the time spent there is not waiting. ``timeout``: (``--timeout``, what ends the
        cell), where the kernel keeps it."""
        self._ask = ask
        self._prompts = prompts
        self._seconds = seconds
        self._timeout = timeout
        self._dashboard = dashboard
        self._stop = threading.Event()
        self._started = time.monotonic()
        self.report = ""
        """The report printed, if any."""
        self.after = 0.0
        """Seconds from the cell's start to the report."""
        self._thread = threading.Thread(target=self._watch, name="nbfsdp-hang-report", daemon=True)

    def start(self) -> HangReporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The cell has ended: no report after this (one being asked for is dropped)."""
        self._stop.set()

    def _watch(self) -> None:
        thresholds = [self._seconds] if self._seconds > 0 else []
        if self._timeout is not None:
            thresholds.append(self._timeout[0])
        if not thresholds or self._stop.wait(min(thresholds)):
            return
        while not self._stop.is_set():
            if self._prompts is not None and self._prompts.stopped_now():
                self._stop.wait(ASK_EVERY_SECONDS)
                continue
            try:
                where = self._ask()
            except Exception:  # the world went while asking: the cell's own error says what happened
                return
            waits = [
                (where.asked_at - p.inside["since"] - self._at_prompts(p.inside["since"]), p)
                for p in where.positions
                if p.answered and p.inside
            ]
            longest, position = max(waits, key=lambda pair: pair[0], default=(0.0, None))
            if self._stop.is_set():
                return
            if self._timeout is not None and position is not None and longest > self._timeout[0]:
                inside = position.inside
                assert inside is not None  # only positions inside a collective were counted
                self._timeout[1](
                    position.rank,
                    f"timed out: waited {longest:.1f} s in {inside['op']} #{inside['seq']} (--timeout "
                    f"{self._timeout[0]:g}; the time ranks sat at a debugger prompt not counted)",
                )
                return
            if 0 < self._seconds < longest and not self.report:
                self._report(longest, where)
                if self._timeout is None:
                    return
            self._stop.wait(ASK_EVERY_SECONDS)

    def _report(self, longest: float, where: Where) -> None:
        self.after = time.monotonic() - self._started
        self.report = (
            f"nbfsdp: a rank has waited {longest:.0f} s in one collective (--hang-report "
            f"{self._seconds:g}); where the ranks are, as %fsdp where says it:\n{where}"
        )
        print(self.report, file=sys.stderr, flush=True)
        if self._dashboard is not None:
            self._dashboard.mark_ranks(rank_marks(where), "hang report: " + "; ".join(where.findings))

    def _at_prompts(self, since: float) -> float:
        return self._prompts.stopped_seconds_since(since) if self._prompts is not None else 0.0


def rank_marks(where: Where) -> dict[int, str]:
    """What the dashboard says in the row of each rank a hang report names: a rank waiting in a collective is
    stuck in it (for how long, issued at which line), and a rank of its group that has not issued that collective
    yet is the one it waits for (with what that rank is doing)."""
    marks: dict[int, str] = {}
    answered = [p for p in where.positions if p.answered]
    for position in answered:
        inside = position.inside
        if not inside:
            continue
        marks[position.rank] = (
            f"stuck in {inside['op']} #{inside['seq']} for {where.asked_at - inside['since']:.0f} s at "
            f"{_line(inside['at'])}"
        )
        for other in answered:
            if other.rank in inside["group"] and other.count(tuple(inside["group"])) < inside["seq"]:
                marks.setdefault(
                    other.rank,
                    f"has not issued {inside['op']} #{inside['seq']} (rank {position.rank} waits in it); "
                    f"{_doing(other, where.asked_at)}",
                )
    return marks


def _line(at: str) -> str:
    """``<fsdp-cell-3>:4 in <module>`` as ``cell line 4``; a library's line as ``file.py:12 in f``."""
    filename, _, rest = at.partition(":")
    if filename.startswith("<fsdp-cell-"):
        return f"cell line {rest.split(' ')[0]}"
    return f"{Path(filename).name}:{rest}" if at else "?"


def _doing(position: RankPosition, now: float) -> str:
    return position.state(now).split(",")[0]
