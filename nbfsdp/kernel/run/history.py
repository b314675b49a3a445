"""The record of every ``%%fsdp`` run, for ``nbfsdp.last_run()`` and ``nbfsdp.runs()``, and of the last
user cell, for ``%fsdp export-script``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.devices import Devices


@dataclass
class LastCell:
    """The last ``%%fsdp`` cell, as ``export-script`` needs it."""

    code: str
    world_size: int
    config: FSDPConfig
    devices: Devices
    per_rank_batches: bool
    reads: list[str]


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """One ``%%fsdp`` cell, as it ran."""

    world_size: int
    """Number of ranks."""
    config: dict[str, Any]
    """The effective settings, in Composer's ``fsdp_config`` vocabulary where one exists."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """One dict per ``nbfsdp.log`` call: ``rank``, ``step``, ``step_time``, the logged names, ``mem_*``.

    Filled as the ranks stream their records while the cell runs (an ``--async`` one too), then
    replaced by every rank's complete list in step order when it ends."""
    elapsed: float = 0.0
    """Wall-clock seconds of the whole cell, as the notebook saw it."""
    ok: bool = True
    """False when a rank failed or the cell was interrupted."""
    error: str = ""
    """The failure, as the cell reported it."""
    changes: list[tuple[int, str]] = field(default_factory=list)
    """Settings changed while the cell ran: (step after which they applied, ``key=value, ...``)."""
    cancelled: bool = False
    """Ended early by ``%fsdp cancel`` or the Stop button, at a step boundary on every rank."""
    predicted_peak: list[int] | None = None
    """Each rank's peak in a training step (bytes) as ``explain`` traces it, with the batch of the notebook
    DataLoader the cell reads or of the model's last ``explain --batch``; None without either. Filled while
    the cell runs (``nbfsdp.kernel.planning.predicted``); the measured peaks are the records' ``mem_peak``."""
    gathered_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes brought back into each notebook model after the cell: only the tensors some rank wrote (a LoRA
    cell's adapters, not its frozen base), a tie once; of a model that lives on the ranks, only its trained
    adapters (``nbfsdp.kernel.run.spec.ADAPTER_SHARE``), or what ``nbfsdp.gather`` asked for."""
    hang_report: str = ""
    """What the cell printed by itself when a rank waited in one collective longer than ``--hang-report`` seconds
    (``%fsdp where``'s report); empty when none did."""
    hang_report_after: float = 0.0
    """Seconds from the cell's start to that report."""
    out_of_memory: dict[str, Any] | None = None
    """A rank ran out of memory: the report the cell printed (``text``) and its parts: ``rank``, ``limit``,
    ``doing``, per rank the bytes by category ``measured`` where it stopped, the planner's ``planned`` bytes
    where the step passes the limit (``planned_at``) and its whole step's ``planned_peak``, and the
    ``fixes`` it offers (each ``flags`` and ``peak``, checked by the planner). None for any other cell."""
    sent_bytes: list[int] = field(default_factory=list)
    """Bytes the notebook sent each rank for this cell: its shards of models sent anew (as the rank
    counted them on arrival), their skeletons and the other names the cell reads."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """The captured steps of every rank (``--timeline``), in step and rank order: each with ``rank``, ``step``,
    ``step_ms``, ``exposed_comm_ms`` (the communication no compute covered on that rank), ``comm_ms``, the
    ``settings`` in force and its ``events`` (each ``lane``: ``compute``, ``all_gather``, ``reduce_scatter``,
    ``optimizer`` or ``nbfsdp``; ``name``; ``unit``; ``start_ms``; ``ms``; ``bytes``). Filled as the ranks send
    them while the cell runs (``nbfsdp.shared.timeline``)."""

    def metric(self, name: str, rank: int = 0) -> list[Any]:
        """One rank's values of ``name``, in step order."""
        return [m[name] for m in self.metrics if m["rank"] == rank and name in m]


_history: list[RunRecord] = []


def record(run: RunRecord) -> None:
    _history.append(run)


def last_run() -> RunRecord | None:
    """The most recent ``%%fsdp`` run in this kernel, or None before the first."""
    return _history[-1] if _history else None


def runs() -> list[RunRecord]:
    """Every ``%%fsdp`` run in this kernel, oldest first."""
    return list(_history)
