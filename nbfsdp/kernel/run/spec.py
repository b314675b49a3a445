"""What a cell is before it runs: how it is to run, its inputs read and pickled, then what every rank is told.

``RunOptions`` is what ``%%fsdp``'s flags (or nbfsdp's own request) ask; ``PreparedCell`` holds everything
known before an engine is touched; ``Delivery`` what the ranks were sent of the models; ``cell_spec`` turns
them, once the world is known, into the ``CellSpec`` the ranks receive. Each is made once and never changed.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from IPython.core.interactiveshell import InteractiveShell

from nbfsdp.kernel.cluster.world import RunningWorld
from nbfsdp.kernel.run import inputs, residence
from nbfsdp.kernel.run.control import RunControl
from nbfsdp.kernel.run.held import EngineHoldings, Fingerprint, fingerprint
from nbfsdp.kernel.run.loaders import LoaderPlan, NotebookLoaders
from nbfsdp.shared import transfer
from nbfsdp.shared.config import CheckpointSettings, FSDPConfig
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.protocol import CellSpec, GatherModel, InternalRequest, IntervalSaves, LoaderSplit, LoaderState
from nbfsdp.shared.units import ties_kept


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """How a cell runs, as ``%%fsdp``'s flags say (or nbfsdp's own request): fixed for the cell."""

    world_size: int
    timeout: float
    """Seconds a collective may wait before it fails."""
    gather: bool = True
    """The trained weights come back into the notebook's models (``--no-gather``: not)."""
    background: bool = False
    """``--async``: the cell returns at once; ``%fsdp wait`` brings its results."""
    per_rank_batches: bool = False
    """``--per-rank-batches``: each rank draws whole batches of the notebook's loaders."""
    checkpointing: CheckpointSettings | None = None
    """With a save interval, the ranks save inside the cell (loads happen before it)."""
    keep_on_ranks: bool = False
    """The cell's models live on the ranks from now on (``residence``): never gathered."""
    hang_report: float = 0.0
    """Seconds a rank may wait in one collective before the cell says where the ranks are; 0, never."""
    timeline: float = 0.0
    """``--timeline``: seconds between captured steps (after the second, and the first after each change); 0,
    none."""


@dataclass(frozen=True, eq=False, kw_only=True)
class PreparedCell:
    """A cell parsed and its inputs read and pickled: everything known before an engine is touched."""

    code: str
    number: int
    reads: list[str]
    config: FSDPConfig
    devices: Devices
    assigned: list[str]
    models: dict[str, nn.Module]
    others: dict[str, Any]
    skeletons: dict[str, bytes]
    fingerprints: dict[str, Fingerprint]
    kept: set[str]
    """Optimizers and schedulers the running world holds as the notebook does: not sent."""
    values: bytes
    sent: dict[str, Any]
    plans: dict[str, LoaderPlan]
    per_rank_batches: bool
    request: InternalRequest | None = None
    """nbfsdp's own cell (``code`` is then empty)."""
    on_ranks: list[str] = field(default_factory=list)
    """The models whose weights live on the ranks (``residence``), or will after this cell (``--keep-on-ranks``):
    never gathered."""

    @property
    def filename(self) -> str:
        return f"<fsdp-cell-{self.number}>"

    @property
    def internal(self) -> bool:
        """nbfsdp's own cell: no dashboard, no run record (``last_run()`` stays the user's last cell)."""
        return self.request is not None

    def sent_to(self, world: RunningWorld) -> PreparedCell:
        """The cell as a world that holds nothing of the notebook's receives it: everything sent, none kept."""
        if not self.kept:
            return self
        values, sent = inputs.pack_inputs(self.others, self.models, set(), world.world_size)
        return replace(self, kept=set(), values=values, sent=sent)


@dataclass(frozen=True)
class Delivery:
    """What the ranks were sent of the cell's models before it runs (``delivery.send_models``)."""

    tokens: dict[str, int]
    """Each model's token on the ranks (a new one for each model sent)."""
    materialize: list[str]
    """Models built on the meta device, sent as skeletons only: the ranks initialize their shards."""
    sources: dict[str, str]
    """Of ``materialize``, the models the ranks read from a checkpoint directory (``CellSpec.sources``)."""
    sending: dict[str, bytes]
    """The skeletons of the models sent anew (their shards were delivered already)."""
    sent_bytes: list[int]
    """The bytes each rank received for the cell: its shards, the inputs, the skeletons."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a checkpoint loaded since the last user cell left the steps and the loaders: that cell resumes there."""

    step: int = 0
    """The cell's ``resume_step``: the checkpoint's step, else 0."""
    loaders: Mapping[str, LoaderState] = field(default_factory=dict)
    """Loaders the checkpoint saved part-way through an epoch: the cell's ranks resume them there."""


def prepare(
    shell: InteractiveShell,
    number: int,
    cell: str | InternalRequest,
    config: FSDPConfig,
    devices: Devices,
    held: EngineHoldings | None,
    loaders: NotebookLoaders,
    world_size: int,
    per_rank_batches: bool,
    keep_on_ranks: bool = False,
) -> PreparedCell:
    """Parse the cell, read its inputs, pickle what the ranks do not hold (``held``: what the running world
    holds, where the cell runs in it). ``keep_on_ranks``: the cell's models live on the ranks from now on."""
    if isinstance(cell, str):
        reads, assigned = transfer.analyze_cell(ast.parse(cell, filename=f"<fsdp-cell-{number}>"))
        code, request = cell, None
    else:  # nbfsdp's own request: it reads the names it lists, and binds none
        reads, assigned, code, request = cell.reads(), [], "", cell
    models, others = inputs.read_inputs(shell, reads)
    skeletons = {name: transfer.model_skeleton(model) for name, model in models.items()}
    for name, model in models.items():  # a rule FSDP2 would refuse (a split tie) fails here, before any engine
        _say_ties_kept(name, model, config)
    fingerprints = {name: fingerprint(model, skeletons[name], config) for name, model in models.items()}
    kept = held.kept_objects(others, models, fingerprints) if held is not None else set()
    values, sent = inputs.pack_inputs(others, models, kept, world_size)
    plans = loaders.plan(sent, world_size, per_rank_batches)
    on_ranks = [name for name, model in models.items() if keep_on_ranks or residence.of(model) is not None]
    return PreparedCell(
        code=code,
        number=number,
        reads=reads,
        config=config,
        devices=devices,
        assigned=assigned,
        models=models,
        others=others,
        skeletons=skeletons,
        fingerprints=fingerprints,
        kept=kept,
        values=values,
        sent=sent,
        plans=plans,
        per_rank_batches=per_rank_batches,
        request=request,
        on_ranks=on_ranks,
    )


#: The models whose kept ties were said, by id and the lines said: once each, not at every cell.
_TIES_SAID: dict[int, list[str]] = {}


def _say_ties_kept(name: str, model: nn.Module, config: FSDPConfig) -> None:
    """Choose the model's units as the ranks will (a ``ConfigError`` for a rule that splits a tie), and say, the
    first time, each unit the default rule left out to keep a tie whole (``units.ties_kept``), one line each."""
    kept = ties_kept(model, config)
    if kept and _TIES_SAID.get(id(model)) != kept:
        _TIES_SAID[id(model)] = kept
        for line in kept:
            print(f"nbfsdp: {name}: {line}", file=sys.stderr)


def interval_saves(private_dir: str, number: int, checkpointing: CheckpointSettings | None) -> IntervalSaves | None:
    """``--save-interval``: where the ranks save, and the directory they agree on each save in."""
    if checkpointing is None or checkpointing.save_interval is None:
        return None
    assert checkpointing.save_folder is not None  # checkpoint_settings requires it with save_interval
    folder = Path(checkpointing.save_folder).expanduser().resolve()  # the engines may run elsewhere
    folder.mkdir(parents=True, exist_ok=True)
    markers = Path(private_dir, f"saves-{number}")
    markers.mkdir()
    return IntervalSaves(
        folder=str(folder),
        interval=checkpointing.save_interval,
        keep=checkpointing.save_num_checkpoints_to_keep,
        markers=str(markers),
    )


def _gathered(prepared: PreparedCell) -> list[str]:
    """The models whose weights come back after the cell: those that live in the notebook; one that lives on
    the ranks only when ``nbfsdp.gather`` asks for it."""
    if isinstance(prepared.request, GatherModel):
        return [prepared.request.model]
    return sorted(set(prepared.models) - set(prepared.on_ranks))


def cell_spec(
    prepared: PreparedCell,
    delivery: Delivery,
    world: RunningWorld,
    gather: bool,
    control: RunControl,
    saves: IntervalSaves | None,
    loaders: NotebookLoaders,
    resume: ResumePoint,
    *,
    timeline: float = 0.0,
) -> CellSpec:
    """What every rank is told to run. ``resume``: where a checkpoint loaded since the last cell left the steps
    and the loaders; ``timeline``: seconds between captured steps (``--timeline``), none for a cell that runs a
    profiler of its own (two cannot run at once)."""
    plans, sent = prepared.plans, prepared.sent
    # with saves on, every loader also carries the epochs it began before, for the saves' count
    epochs = {name: LoaderState(epochs=loaders.epochs(sent[name]), generators=[]) for name in plans}
    return CellSpec(
        code=prepared.code,
        request=prepared.request,
        filename=prepared.filename,
        generation=world.generation,
        models=list(prepared.models),
        model_tokens=delivery.tokens,
        assigned=prepared.assigned,
        gather=_gathered(prepared) if gather else [],
        fsdp=prepared.config,
        materialize=delivery.materialize,
        sources=delivery.sources,
        on_ranks=prepared.on_ranks,
        trained_back=prepared.on_ranks if gather and prepared.request is None else [],
        seed=torch.initial_seed() % 2**63,
        control=control.for_ranks,
        cwd=os.getcwd(),
        loaders={
            name: LoaderSplit(per_rank=prepared.per_rank_batches, seed_state=loaders.shuffle_state(sent[name]))
            for name in plans
        },
        resume_step=resume.step,
        ranks_per_gpu=world.devices.ranks_per_gpu,
        saves=saves,
        kept=sorted(prepared.kept),
        loader_resume={
            **(epochs if saves is not None else {}),
            **{name: state for name, state in resume.loaders.items() if name in plans},
        },
        timeline=0.0 if prepared.request is not None or profiles_itself(prepared.code) else timeline,
    )


def profiles_itself(code: str) -> bool:
    """The cell runs ``torch.profiler`` (or autograd's) itself: a capture of the timeline would refuse to start
    inside it, or make the cell's own fail to."""
    return re.search(r"\bprofiler\b", code) is not None
