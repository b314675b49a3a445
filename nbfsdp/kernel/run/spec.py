"""What a cell is before it runs: how it is to run, its inputs read and pickled, then what every rank is told.

``RunOptions`` is what ``%%fsdp``'s flags (or nbfsdp's own request) ask; ``PreparedCell`` holds everything
known before an engine is touched, each model read as one ``CellModel``; ``Delivery`` what the ranks were sent
of the models, each with its ``ModelRoute``; ``cell_spec`` turns them, once the world is known, into the
``CellSpec`` the ranks receive. Each is made once and never changed.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn as nn
from IPython.core.interactiveshell import InteractiveShell

from nbfsdp.kernel.cluster.world import RunningWorld
from nbfsdp.kernel.run import inputs, residence
from nbfsdp.kernel.run.control import RunControl
from nbfsdp.kernel.run.debugging import calls_debugger
from nbfsdp.kernel.run.held import EngineHoldings, Fingerprint, fingerprint
from nbfsdp.kernel.run.loaders import LoaderPlan, NotebookLoaders
from nbfsdp.shared import transfer
from nbfsdp.shared.config import CheckpointSettings, FSDPConfig
from nbfsdp.shared.protocol import (
    CellSpec,
    GatherModel,
    InternalRequest,
    IntervalSaves,
    LoaderSplit,
    LoaderState,
    ModelRoute,
    Returns,
)
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
    debug_ranks: list[int] | None = None
    """``--debug-rank``: the ranks a ``breakpoint()`` stops; None, every rank."""


@dataclass(frozen=True, eq=False, kw_only=True)
class CellModel:
    """One of the notebook's models a cell reads, as the kernel knows it before an engine is touched."""

    module: nn.Module
    skeleton: bytes
    """Its pickled skeleton (``transfer.model_skeleton``): what the ranks build it from when it is sent."""
    fingerprint: Fingerprint
    """What the ranks must hold for it to need no sending (``held.fingerprint``)."""
    on_ranks: bool
    """Its weights live on the ranks (``residence``), or will after this cell (``--keep-on-ranks``): never
    gathered."""
    returns: Returns
    """What of it comes back after the cell (``returns_of``)."""


@dataclass(frozen=True, eq=False, kw_only=True)
class PreparedCell:
    """A cell parsed and its inputs read and pickled: everything known before an engine is touched."""

    code: str
    number: int
    reads: list[str]
    config: FSDPConfig
    options: RunOptions
    assigned: list[str]
    models: dict[str, CellModel]
    others: dict[str, Any]
    kept: set[str]
    """Optimizers and schedulers the running world holds as the notebook does: not sent."""
    values: bytes
    sent: dict[str, Any]
    plans: dict[str, LoaderPlan]
    request: InternalRequest | None = None
    """nbfsdp's own cell (``code`` is then empty)."""

    @property
    def filename(self) -> str:
        return f"<fsdp-cell-{self.number}>"

    @property
    def internal(self) -> bool:
        """nbfsdp's own cell: no dashboard, no run record (``last_run()`` stays the user's last cell)."""
        return self.request is not None

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The cell's models themselves, by name."""
        return {name: model.module for name, model in self.models.items()}

    def sent_to(self, world: RunningWorld) -> PreparedCell:
        """The cell as a world that holds nothing of the notebook's receives it: everything sent, none kept."""
        if not self.kept:
            return self
        values, sent = inputs.pack_inputs(self.others, self.modules, set(), world.world_size)
        return replace(self, kept=set(), values=values, sent=sent)


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """What the ranks were sent of the cell's models before it runs (``delivery.send_models``)."""

    routes: dict[str, ModelRoute]
    """Each model's route, as every rank is told it (``CellSpec.models``): its token (a new one for each model
    sent), how it arrives, what comes back."""
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


class Notebook(Protocol):
    """What preparing a cell reads of the session: the notebook's names, what the running world holds of them,
    and its loaders' bookkeeping."""

    shell: InteractiveShell
    held: EngineHoldings
    loaders: NotebookLoaders


def prepare(
    notebook: Notebook,
    cell: str | InternalRequest,
    *,
    number: int,
    config: FSDPConfig,
    options: RunOptions,
    in_running_world: bool,
) -> PreparedCell:
    """Parse the cell, read its inputs, pickle what the ranks do not hold (what the running world holds counts
    only ``in_running_world``), and decide each model's part in it."""
    held = notebook.held if in_running_world else None
    if isinstance(cell, str):
        reads, assigned = transfer.analyze_cell(ast.parse(cell, filename=f"<fsdp-cell-{number}>"))
        code, request = cell, None
    else:  # nbfsdp's own request: it reads the names it lists, and binds none
        reads, assigned, code, request = cell.reads(), [], "", cell
    modules, others = inputs.read_inputs(notebook.shell, reads)
    models = {}
    for name, module in modules.items():  # a rule FSDP2 would refuse (a split tie) fails here, before any engine
        _say_ties_kept(name, module, config)
        skeleton = transfer.model_skeleton(module)
        on_ranks = options.keep_on_ranks or residence.of(module) is not None
        models[name] = CellModel(
            module=module,
            skeleton=skeleton,
            fingerprint=fingerprint(module, skeleton, config),
            on_ranks=on_ranks,
            returns=returns_of(name, module, on_ranks=on_ranks, gather=options.gather, request=request),
        )
    fingerprints = {name: model.fingerprint for name, model in models.items()}
    kept = held.kept_objects(others, modules, fingerprints) if held is not None else set()
    values, sent = inputs.pack_inputs(others, modules, kept, options.world_size)
    return PreparedCell(
        code=code,
        number=number,
        reads=reads,
        config=config,
        options=options,
        assigned=assigned,
        models=models,
        others=others,
        kept=kept,
        values=values,
        sent=sent,
        plans=notebook.loaders.plan(sent, options.world_size, per_rank_batches=options.per_rank_batches),
        request=request,
    )


#: A model living on the ranks brings its trained parameters back after a cell where they are at most this share
#: of its parameters' bytes: adapters (LoRA's are well under 1%) on a frozen base, which stays on the ranks.
ADAPTER_SHARE = 0.1


def returns_of(
    name: str, model: nn.Module, *, on_ranks: bool, gather: bool, request: InternalRequest | None
) -> Returns:
    """What of ``model`` comes back after the cell, the one place this is decided: nothing under ``--no-gather``;
    all of it for ``nbfsdp.gather``; what changed of a model that lives in the notebook; of one that lives on the
    ranks, after a user's cell, its trained adapters where its trainable parameters are a small part of it
    (``ADAPTER_SHARE``: a LoRA model), else nothing."""
    if not gather:
        return Returns.NOTHING
    if isinstance(request, GatherModel):
        return Returns.ALL if name == request.model else Returns.NOTHING
    if not on_ranks:
        return Returns.CHANGED
    if request is not None:
        return Returns.NOTHING
    params = list({id(p): p for p in model.parameters()}.values())
    trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    total = sum(p.numel() * p.element_size() for p in params)
    return Returns.ADAPTERS if 0 < trained <= ADAPTER_SHARE * total else Returns.NOTHING


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


@dataclass(frozen=True, kw_only=True)
class RunFiles:
    """What a run keeps for its ranks in the cluster's private directory, removed when it ends: its live-control
    request file, and with ``--save-interval`` the directory the ranks agree on each save in."""

    control: RunControl
    saves: IntervalSaves | None

    def remove(self) -> None:
        self.control.remove()
        if self.saves is not None:
            shutil.rmtree(self.saves.markers, ignore_errors=True)


def run_files(private_dir: str, prepared: PreparedCell, *, unsteerable: str | None) -> RunFiles:
    """The run's files (``unsteerable``: why its ranks cannot all see the directory; then none steers it)."""
    saves = interval_saves(private_dir, prepared.number, prepared.options.checkpointing)
    return RunFiles(control=RunControl(private_dir, prepared.number, unsteerable), saves=saves)


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


def cell_spec(
    prepared: PreparedCell,
    delivery: Delivery,
    *,
    world: RunningWorld,
    files: RunFiles,
    loaders: NotebookLoaders,
    resume: ResumePoint,
) -> CellSpec:
    """What every rank is told to run. ``resume``: where a checkpoint loaded since the last cell left the steps
    and the loaders. No step is captured (``--timeline``) in a cell that runs a profiler of its own (two cannot
    run at once)."""
    plans, sent, saves = prepared.plans, prepared.sent, files.saves
    # with saves on, every loader also carries the epochs it began before, for the saves' count
    epochs = {name: LoaderState(epochs=loaders.epochs(sent[name]), generators=[]) for name in plans}
    return CellSpec(
        code=prepared.code,
        request=prepared.request,
        filename=prepared.filename,
        generation=world.generation,
        models=delivery.routes,
        assigned=prepared.assigned,
        fsdp=prepared.config,
        seed=torch.initial_seed() % 2**63,
        control=files.control.for_ranks,
        cwd=os.getcwd(),
        loaders={
            name: LoaderSplit(per_rank=prepared.options.per_rank_batches, seed_state=loaders.shuffle_state(sent[name]))
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
        timeline=0.0 if prepared.request is not None or profiles_itself(prepared.code) else prepared.options.timeline,
        debug_ranks=[] if prepared.options.background else prepared.options.debug_ranks,
        breakpoints=prepared.request is None
        and not prepared.options.background
        and bool(files.control.for_ranks)  # where no prompt can come, breakpoints are passed over
        and calls_debugger(prepared.code, [*prepared.modules.values(), *prepared.others.values()]),
    )


def profiles_itself(code: str) -> bool:
    """The cell runs ``torch.profiler`` (or autograd's) itself: a capture of the timeline would refuse to start
    inside it, or make the cell's own fail to."""
    return re.search(r"\bprofiler\b", code) is not None
