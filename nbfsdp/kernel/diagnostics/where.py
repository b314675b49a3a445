"""``%fsdp where``: each rank's Python stack and its collectives while a cell runs, and which rank left the
others waiting (the kernel's side; the ranks' side is ``nbfsdp.engines.where``).

A hang in distributed training is almost always a collective that some ranks issued and another did not
(a branch on the rank, an early ``break``, an exception caught on one rank), or issued in another order.
Every rank numbers the collectives of each process group as it issues them, so the ranks' ledgers side
by side say it at once: rank 0 waits in its 38th all-reduce, which rank 1, whose cell has ended, never
issued. The notebook asks by writing a request file in the directory the ranks watch; each rank's watcher
thread answers within a fraction of a second, even while its main thread is blocked in the collective.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

from nbfsdp.kernel.cluster.world import Cluster
from nbfsdp.shared.protocol import where_answer, where_request

#: How long the notebook waits for every rank's answer.
ANSWER_SECONDS = 3.0
#: The innermost frames of a rank's stack that are shown.
SHOWN_FRAMES = 6
#: The ledger's own wrapper, left out of the stacks shown.
_LEDGER_FRAME = f"nbfsdp{os.sep}engines{os.sep}where.py"


@dataclass
class RankPosition:
    """One rank's answer: its main thread's stack, whether it runs a cell, its ledger of collectives."""

    rank: int
    host: str = ""
    answered: bool = True
    in_cell: bool = False
    stack: list[str] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)
    flights: list[dict[str, Any]] = field(default_factory=list)
    """The flight recorder's last collectives (``engines.where.flight_recorder``), where it records."""

    @property
    def inside(self) -> dict[str, Any] | None:
        """The collective this rank is blocked in, if any."""
        return self.ledger.get("inside")

    def count(self, group: tuple[int, ...]) -> int:
        """The collectives this rank issued on ``group``."""
        return next((g["count"] for g in self.ledger.get("groups", []) if tuple(g["ranks"]) == group), 0)

    def recent(self, group: tuple[int, ...]) -> dict[int, dict[str, Any]]:
        """Its latest collectives on ``group``, by number."""
        entries: list[dict[str, Any]] = next(
            (g["recent"] for g in self.ledger.get("groups", []) if tuple(g["ranks"]) == group), []
        )
        return {entry["seq"]: entry for entry in entries}

    def state(self, now: float) -> str:
        if not self.answered:
            return f"no answer within {ANSWER_SECONDS:g} s"
        if not self.in_cell:
            return "idle: its cell has ended, or none runs"
        inside = self.inside
        if inside:
            return (
                f"waiting in {inside['op']} #{inside['seq']} of group {_group(inside['group'])} for "
                f"{now - inside['since']:.1f} s, issued at {_short(inside['at'])}"
            )
        return "running the cell, not in a collective"

    def frames(self) -> list[str]:
        """The stack from the cell inwards, its innermost ``SHOWN_FRAMES`` frames."""
        start = next((i for i, line in enumerate(self.stack) if 'File "<fsdp-cell-' in line), len(self.stack))
        frames = [line for line in self.stack[start:] or self.stack if _LEDGER_FRAME not in line]
        return frames[-SHOWN_FRAMES:]


@dataclass
class Where:
    """Where every rank is, and what that says."""

    positions: list[RankPosition]
    findings: list[str]
    asked_at: float

    def __str__(self) -> str:
        lines = []
        for position in self.positions:
            host = f" ({position.host})" if position.host else ""
            lines.append(f"rank {position.rank}{host}: {position.state(self.asked_at)}")
            if position.answered and position.in_cell:
                lines += ["    " + line.rstrip().replace("\n", "\n    ") for line in position.frames()]
            if position.flights:
                lines.append(f"    flight recorder: {flight_words(position.flights)}")
        return "\n".join(lines + [""] + self.findings)

    def interrupted_at(self) -> str:
        """Where an interrupt found the ranks, in a line: those waiting in a collective, and where it was issued."""
        waiting = [
            f"rank {p.rank} was in {inside['op']} #{inside['seq']} (issued at {_short(inside['at'])})"
            for p in self.positions
            if p.answered and (inside := p.inside)
        ]
        return ", ".join(waiting) or "no rank was waiting in a collective"


def ask_where(directory: str, ranks: int, hosts: list[str] | None = None, seconds: float = ANSWER_SECONDS) -> Where:
    """Ask every rank of a world of ``ranks`` watching ``directory`` where it is, and read the answers."""
    request = where_request(directory)
    try:
        number = int(request.read_text()) + 1
    except (OSError, ValueError):
        number = 1
    partial = request.with_suffix(".partial")
    partial.write_text(str(number))
    partial.replace(request)
    asked_at = time.time()
    deadline = time.monotonic() + seconds
    answers: dict[int, dict[str, Any]] = {}
    while len(answers) < ranks and time.monotonic() < deadline:
        for rank in range(ranks):
            path = where_answer(directory, number, rank)
            if rank not in answers and path.exists():
                answers[rank] = json.loads(path.read_text())
                path.unlink()
        time.sleep(0.05)
    positions = [
        RankPosition(
            rank=rank,
            host=(hosts[rank] if hosts and len(set(hosts)) > 1 else ""),
            answered=rank in answers,
            in_cell=answers.get(rank, {}).get("in_cell", False),
            stack=answers.get(rank, {}).get("stack", []),
            ledger=answers.get(rank, {}).get("ledger", {}),
            flights=answers.get(rank, {}).get("flight_recorder", []),
        )
        for rank in range(ranks)
    ]
    return Where(positions, diagnose(positions), asked_at)


def diagnose(positions: list[RankPosition]) -> list[str]:
    """Which ranks left which waiting: per process group, the collectives each rank issued, and the first
    number at which their operations differ."""
    answered = [p for p in positions if p.answered]
    groups = {tuple(g["ranks"]) for p in answered for g in p.ledger.get("groups", [])}
    findings = []
    for group in sorted(groups, key=lambda g: (-len(g), g)):
        members = [p for p in answered if p.rank in group]
        counts = {p.rank: p.count(group) for p in members}
        for number in sorted({n for p in members for n in p.recent(group)}):
            ops = {p.rank: p.recent(group)[number]["op"] for p in members if number in p.recent(group)}
            if len(set(ops.values())) > 1:
                said = ", ".join(f"rank {rank} {op}" for rank, op in sorted(ops.items()))
                findings.append(f"collectives out of order on group {_group(group)}: #{number} is {said}")
                break
        if len(set(counts.values())) > 1:
            most = max(counts.values())
            behind = sorted(rank for rank, count in counts.items() if count < most)
            ahead = sorted(rank for rank, count in counts.items() if count == most)
            waiting = [inside for p in members if p.rank in ahead and (inside := p.inside) and inside["seq"] == most]
            what = f"{waiting[0]['op']} #{most}" if waiting else f"collective #{most}"
            issued = ", ".join(f"rank {rank} issued {counts[rank]}" for rank in behind)
            where_behind = "; ".join(
                f"rank {p.rank} is {p.state(time.time()).split(',')[0]}" for p in members if p.rank in behind
            )
            findings.append(
                f"{_ranks(ahead)} issued {what} on group {_group(group)}, which {_ranks(behind)} did not "
                f"({issued} there): {where_behind}"
            )
    missing = [p.rank for p in positions if not p.answered]
    if missing:
        findings.append(f"{_ranks(missing)} did not answer: a rank holding the GIL in Python code, or gone")
    if not findings:
        totals = sorted({sum(g["count"] for g in p.ledger.get("groups", [])) for p in answered})
        findings.append(
            f"every rank has issued the same collectives ({totals[-1] if totals else 0}), in the same order: "
            "no rank is waiting for another"
        )
    return findings


def flight_words(flights: list[dict[str, Any]]) -> str:
    """A rank's last collectives as its flight recorder saw them, in a line: each its group's name, number,
    operation, input sizes and state."""
    return "; ".join(f"{f['op']} #{f['seq']} of group {f['group']} {f['sizes']} {f['state']}" for f in flights)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _group(ranks: list[int] | tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, ranks)) + ")"


def _short(at: str) -> str:
    """``/path/to/file.py:12 in f`` as ``file.py:12 in f``; a cell's line as it is."""
    return str(Path(at.split(":")[0]).name) + at[len(at.split(":")[0]) :] if at else "?"


def where_of(cluster: Cluster, seconds: float = ANSWER_SECONDS) -> Where:
    """Where each rank of ``cluster``'s running world is: its stack and collectives (the ranks that have not
    answered within ``seconds`` said so)."""
    world = cluster.world
    if world is None:
        raise UsageError("%fsdp where: no world is running (a cell starts one)")
    if why := cluster.unsteerable():
        raise UsageError(f"%fsdp where: {why}")
    return ask_where(cluster.private_dir, world.world_size, cluster.rank_hosts(), seconds)
