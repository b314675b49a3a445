"""The messages between the notebook's kernel and the engines (the ranks), in one place.

Both sides import this module, so a field added or renamed here is seen by both, and a reader
finds here everything that crosses the line:

- ``CellSpec``: what the kernel asks each rank to run (``nbfsdp.engines.engine.run_cell``): a user's cell,
  or one of nbfsdp's own requests (``LoadCheckpoint``, ``LoadWeightsFile``), typed, never source text;
  each model it reads with its ``ModelRoute`` (how it reaches the rank, what of it comes back);
- ``CellOutcome``: what each rank answers, or what the kernel records for a rank that gave no answer;
- ``WorldSetup``: what each rank is told to join a new world with, by either cluster;
- ``EngineInfo``: an engine once it joined the world;
- ``ShardAllocation``: how a rank allocates the shards ``nbfsdp.kernel.run.delivery`` sends it;
- ``ControlRequest`` and its files: live changes and cancel, read by the ranks at step boundaries;
- ``SaveTarget``: where every rank saves a checkpoint (``%fsdp save``'s, or an interval save's);
- ``BarDrawing``: rank 0's progress-bar lines on stderr, turned into displays by the kernel.

The objects travel by cloudpickle through ipyparallel; classes of an importable module go by
reference, so the engines unpickle them as these very classes. The metric records (``nbfsdp.log``'s)
stay plain dicts: their keys are public API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbfsdp.shared.config import FSDPConfig

if TYPE_CHECKING:
    import torch

    from nbfsdp.shared.transfer import TensorLayout


@dataclass(kw_only=True, slots=True)
class LoaderSplit:
    """How a rank takes its part of one of the notebook's DataLoaders (``nbfsdp.engines.loaders.split``)."""

    per_rank: bool
    """``--per-rank-batches``: each rank draws whole batches of its own, instead of a slice of each batch."""
    seed_state: torch.Tensor | None
    """The state of the generator the notebook keeps for a loader without one of its own, so every rank
    shuffles in one order; None when the loader has its own generator."""


@dataclass(kw_only=True, slots=True, frozen=True)
class WorldSetup:
    """What a rank joins a new world with (``nbfsdp.engines.engine.setup``): nbfsdp's own cluster and an
    attached one each send one per rank, so both say the same things by the same names."""

    rank: int
    world_size: int
    backend: str
    """``nccl`` on GPUs, ``gloo`` on the CPU."""
    timeout: float
    """Seconds a collective may wait before it fails."""
    threads: int
    """torch's intra-op threads on the rank (its share of its host's cores)."""
    generation: int
    """The world's number in its cluster: what the kernel's later calls name to reach this world."""
    store_path: str | None = None
    """nbfsdp's own cluster: the world's ``FileStore``, a fresh file in its private directory."""
    rendezvous: tuple[str, int] | None = None
    """An attached cluster: rank 0's address and port (``nbfsdp.engines.hosts.open_rendezvous``)."""
    environment: dict[str, str] = field(default_factory=dict)
    """torchrun's variables, and ``NCCL_HOSTID`` where ranks share a GPU."""
    gpu: int | None = None
    """The index of the rank's GPU among those its engine sees (NCCL); None on the CPU (gloo)."""
    where_dir: str | None = None
    """Where ``%fsdp where`` asks the rank where it is (a directory the notebook sees; None where it sees none)."""


@dataclass(kw_only=True, slots=True)
class EngineInfo:
    """An engine once it joined the world (``nbfsdp.engines.engine.setup``), as ``%fsdp status`` shows it."""

    rank: int | None
    """Its rank; None before it joined a world."""
    pid: int
    device: str
    """Its device, with the GPU's name on CUDA (``cuda:0 (NVIDIA H100 ...)``); empty before a world."""
    backend: str
    """The process group's backend (``gloo``, ``nccl``); empty before a world."""
    threads: int
    """torch's intra-op threads on this rank."""
    host: str = ""
    """The engine's host name."""


@dataclass(kw_only=True, slots=True, frozen=True)
class HostIdentity:
    """The host an engine runs on, as it says (``nbfsdp.engines.hosts.identity``)."""

    hostname: str
    key: str
    """Equal for the engines of one host, and only for them: what ranks are grouped by."""
    pid: int
    """The engine's process id on that host."""
    gpus: int = 0
    """The GPUs this engine sees (all of its host's, unless the engine's CUDA_VISIBLE_DEVICES narrows them)."""
    capability: tuple[int, int] | None = None
    """The compute capability of its host's oldest GPU (``nbfsdp.shared.devices.gpu_capability``); None without."""
    slurm_procid: int | None = None
    """``SLURM_PROCID`` where a Slurm step started the engine: its rank, as Slurm numbers the job's tasks."""
    visible_gpus: str | None = None
    """The engine's ``CUDA_VISIBLE_DEVICES`` as its launcher set it (Slurm's GPU binding: ``0,1`` for a task that
    shares its node's GPUs, ``1`` for one bound to its own); None where unset."""


@dataclass(kw_only=True, slots=True)
class LoaderState:
    """Where rank 0's part of a loader left off, so the notebook's loader shuffles on from there."""

    epochs: int
    """Epochs the rank began (an iterator that drew its first batch)."""
    generators: list[torch.Tensor]
    """The states of the generators its shuffle draws from, in ``shuffle_generators`` order."""
    taken: int = 0
    """Saved part-way through an epoch (an interval save): the batches of that epoch already taken, and
    ``generators`` are then the states that epoch drew its shuffle from; 0 otherwise."""


@dataclass(kw_only=True, slots=True)
class IntervalSaves:
    """``--save-folder``/``--save-interval``: where and when every rank saves inside a cell."""

    folder: str
    """The save folder, absolute (the engines may run in another directory)."""
    interval: int
    """At ``nbfsdp.log(step=s)`` with ``(s + 1) % interval == 0`` the ranks save ``step-<s+1>``."""
    keep: int
    """``save_num_checkpoints_to_keep``: -1 keeps all."""
    markers: str
    """A directory of the cluster's private one, new for the cell: the ranks agree on each save there
    through files (``nbfsdp.engines.control.SaveAgreement``), with no collective."""


@dataclass(kw_only=True, slots=True)
class LoadCheckpoint:
    """nbfsdp's own cell: every rank reads checkpoint ``directory`` into the sharded models, optimizers and
    schedulers of these names (``nbfsdp.engines.loading.load_into``)."""

    directory: str
    models: list[str]
    optimizers: dict[str, str]
    """Each optimizer's name -> the name of the model it optimizes."""
    schedulers: list[str]
    ignore: list[str]
    """Globs on the checkpoint's keys left unread."""
    restore_rng: bool
    """The world size that saved it: each rank's RNG states carry over too."""
    rebuilt: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Optimizers a cell made on the ranks, which the notebook has none of: name -> the manifest's recipe and
    its model's name (``owner``); each rank builds it again under its name, then loads its state."""

    def reads(self) -> list[str]:
        """The notebook's names the ranks need: sent (or kept) as a user cell's would be."""
        return [*self.models, *(n for n in self.optimizers if n not in self.rebuilt), *self.schedulers]


@dataclass(kw_only=True, slots=True)
class LoadWeightsFile:
    """nbfsdp's own cell: every rank reads its rows of a full-weights file into the sharded model ``model``
    (``nbfsdp.engines.loading.load_weights_file``)."""

    path: str
    model: str
    read_when_sharded: bool = False
    """The model is on the meta device in the notebook: the ranks read the file as they shard it
    (``CellSpec.sources``), and the request itself has nothing left to do."""

    def reads(self) -> list[str]:
        return [self.model]


@dataclass(kw_only=True, slots=True)
class GatherModel:
    """nbfsdp's own cell (``nbfsdp.gather``): rank 0 sends the full weights of model ``model``, which lives on
    the ranks, in ``dtype`` (a ``torch`` dtype's name) where given; the ranks keep theirs."""

    model: str
    dtype: str | None = None

    def reads(self) -> list[str]:
        return [self.model]


#: What nbfsdp itself asks the ranks to run between the user's cells.
InternalRequest = LoadCheckpoint | LoadWeightsFile | GatherModel


class Arrival(Enum):
    """How a model's shards reach each rank for a cell."""

    HELD = "held"
    """The rank holds them from an earlier cell of this world, as the notebook has them: nothing is sent."""
    DELIVERED = "delivered"
    """The notebook's weights, each rank's shards sent in pieces before the cell (``nbfsdp.kernel.run.delivery``)."""
    INITIALIZED = "initialized"
    """Built on the meta device: each rank initializes its own shards under the notebook's seed."""
    READ = "read"
    """Each rank reads its shards from the route's ``source``, a Hugging Face checkpoint directory (only what that
    lacks is initialized)."""


class Returns(Enum):
    """What of a model comes back into the notebook after a cell (rank 0 sends it), decided by the kernel."""

    NOTHING = "nothing"
    """``--no-gather``, or a model that lives on the ranks and trains more than adapters."""
    CHANGED = "changed"
    """The tensors some rank holds otherwise than the notebook has them, whole (a LoRA cell's adapters, not its
    frozen base)."""
    ALL = "all"
    """The whole state dict, changed or not (``nbfsdp.gather``: the notebook has only a skeleton)."""
    ADAPTERS = "adapters"
    """Of a model living on the ranks whose trainable parameters are a small part of it (a LoRA model), those
    that changed; its frozen base stays on the ranks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRoute:
    """One model's way through a cell, as every rank is told it: the one record of it on the wire."""

    token: int
    """Which delivery or earlier cell the rank's copy must come from (a new one for each model sent)."""
    arrives: Arrival
    returns: Returns
    on_ranks: bool = False
    """Its weights live on the ranks (``nbfsdp.kernel.run.residence``): the ranks tell whether the cell changed
    them."""
    source: str | None = None
    """With ``Arrival.READ``, the checkpoint directory each rank reads its shards from."""

    @property
    def watched(self) -> bool:
        """Whether the ranks find out which of its tensors the cell changed: those of a model that may come back,
        and of one that lives on the ranks (a world that ends would lose its changes)."""
        return self.returns is not Returns.NOTHING or self.on_ranks


@dataclass(kw_only=True, slots=True)
class CellSpec:
    """One ``%%fsdp`` cell as every rank runs it; the same object goes to each rank."""

    code: str
    """The cell's source ('' for nbfsdp's own ``request``)."""
    filename: str
    """``<fsdp-cell-N>``: the name tracebacks show the cell's lines under."""
    generation: int
    """The world the kernel submitted to; a rank of another (restarted) world refuses the cell."""
    models: dict[str, ModelRoute]
    """The notebook's models the cell reads, by name, each with its route."""
    assigned: list[str]
    """The names the cell binds at top level: candidates to bring back to the notebook."""
    fsdp: FSDPConfig
    """The cell's settings, validated by the kernel (the object itself, so a rank gets types, not a dict)."""
    seed: int
    """The notebook's torch seed: meta-built models initialize under it."""
    control: str
    """The path of the cell's live-control request file (``control_file``), or '' where the ranks cannot
    all see one (hosts that share no directory with the notebook): then nothing steers the cell."""
    cwd: str = ""
    """The notebook's working directory: a rank runs the cell there where its host has it (a pasted script's
    relative paths mean what they mean in the notebook, as a torchrun worker's mean the launch directory)."""
    loaders: dict[str, LoaderSplit] = field(default_factory=dict)
    """The notebook's DataLoaders the cell reads, and how each rank splits each."""
    resume_step: int = 0
    """``resume_step`` in the cell: the step after the checkpoint loaded just before it, else 0."""
    saves: IntervalSaves | None = None
    """``--save-interval``: checkpoints taken at ``nbfsdp.log`` calls; None without."""
    loader_resume: dict[str, LoaderState] = field(default_factory=dict)
    """Loaders a checkpoint loaded just before saved part-way through an epoch: each rank's first epoch
    of them shuffles from the saved states again and skips the batches taken (``LoaderState.taken``)."""
    kept: list[str] = field(default_factory=list)
    """The notebook's optimizers and schedulers the cell reads that the ranks hold as the notebook does:
    not sent; each rank takes its own from its namespace."""
    ranks_per_gpu: int = 1
    """GPU ranks: how many share this rank's GPU (each may allocate 1/k of it unless ``fsdp.memory_limit``)."""
    request: InternalRequest | None = None
    """nbfsdp's own cell, run instead of ``code``: no run record, the notebook's names as the user's cell
    would have them."""
    timeline: float = 0.0
    """``--timeline``: each rank captures its second step, the first after each live change, then one every
    this many seconds (``nbfsdp.engines.timeline``); 0, none."""
    debug_ranks: list[int] | None = None
    """``--debug-rank``: the ranks a ``breakpoint()`` stops; None, every rank; [] none (an ``--async`` cell)."""
    breakpoints: bool = False
    """The kernel saw the cell (or a notebook function or model class it runs) call the debugger: its collectives
    wait for a rank at a prompt (the kernel keeps ``--timeout`` itself, less the time at prompts)."""

    @property
    def gathers(self) -> bool:
        """Some model's weights come back whole where changed: the notebook's optimizers and schedulers the cell
        read bring their state back too, and the names assigned refer to the notebook's own parameters."""
        return any(route.returns in (Returns.CHANGED, Returns.ALL) for route in self.models.values())


@dataclass(frozen=True, slots=True)
class TensorShape:
    """A tensor a rank's model was called with, as the kernel's planner traces it: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(kw_only=True, slots=True)
class CellOutcome:
    """A rank's end of a cell: ``ok`` and what comes back, or ``failed`` and why.

    One class for both shapes: the kernel watches every rank's outcome alike (``ok``, ``metrics``),
    and a rank that died or was killed gets a failed one made by the kernel (``CellOutcome.failed``).
    Only rank 0 fills ``names``, ``skipped``, ``in_place``, ``loaders`` and ``states``.
    """

    ok: bool
    """The cell ran to its end (or to a cancel) on this rank."""
    cancelled: bool = False
    """``%fsdp cancel`` ended the cell at an agreed step; it still counts as finished."""
    names: dict[str, bytes] = field(default_factory=dict)
    """The names the cell assigned, pickled (``transfer.pickle_result``), to bind in the notebook."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Assigned names that stay on the engines, with why."""
    in_place: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The trained state dicts of the notebook's own optimizers and schedulers the cell read (loaded in place)."""
    loaders: dict[str, LoaderState] = field(default_factory=dict)
    """Rank 0's state of each split DataLoader (``SplitLoader.state``): the notebook's shuffles on from it."""
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    """The gathered models' full state dicts, on the CPU."""
    written: list[str] = field(default_factory=list)
    """The cell's models some rank holds otherwise than the notebook last had them (or than they were read
    from their checkpoint): what a world that ends would lose of a model that lives on the ranks."""
    settings: dict[str, FSDPConfig] = field(default_factory=dict)
    """Each model's settings at the end, live changes included: what the engine holds it under now."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """This rank's ``nbfsdp.log`` records (public keys), also those of a failed cell up to its error."""
    error: str = ""
    """A failed rank: ``ExceptionType: message``."""
    traceback: str = ""
    """A failed rank: the user's traceback, nbfsdp's own frames left out; empty when none was taken."""
    secondary: bool = False
    """The failure only follows another's (a peer tore the world down, or the kernel interrupted this
    rank because of it): the cell's error names a primary failure first."""
    engine_lost: bool = False
    """The engine process went away under the task: the kernel asks how it died."""
    memory: dict[str, Any] | None = None
    """A failed rank: its bytes by category where it stopped, and, where it ran out of memory, what it was
    doing and the shapes of its model's last call (``nbfsdp.engines.memory_limit.RankMemory.report``)."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """This rank's captured steps (``nbfsdp.shared.timeline``), also those of a failed cell up to its error."""
    quit_debugger: bool = False
    """The cell ended because ``q`` was typed at this rank's debugger prompt: not an error of the cell's."""
    kept_frames: bool = False
    """This rank keeps its failed frames for ``%debug`` (``nbfsdp.engines.debugging``)."""

    @classmethod
    def failed(cls, error: str, *, secondary: bool = False, engine_lost: bool = False) -> CellOutcome:
        """A failed rank with nothing recorded: as the kernel records a rank that gave no answer. A rank whose
        cell failed builds its own ``CellOutcome(ok=False, ...)`` with its traceback and what it recorded."""
        return cls(ok=False, error=error, secondary=secondary, engine_lost=engine_lost)


@dataclass(frozen=True, kw_only=True, slots=True)
class SaveTarget:
    """Where every rank saves one checkpoint (``nbfsdp.engines.checkpointing.save``), in one record: the
    kernel's ``%fsdp save`` and a rank's ``--save-interval`` name a save alike, and it reaches each rank whole."""

    partial: str
    """The hidden directory the ranks write into; nothing complete is there until rank 0 completes it."""
    final: str
    """Where the checkpoint appears, complete, once every rank has written."""
    step: int | None
    """The step training resumes at, for the manifest; None when no step was logged."""
    overwrite: bool
    """A complete checkpoint already at ``final`` is replaced."""
    disk_full_then: str = "the engines still hold the trained state (free some space, or save somewhere else)"
    """What a full disk leaves, said in its error: by default (``%fsdp save``) the engines, untouched by a
    failed write."""


@dataclass(kw_only=True, slots=True)
class ShardAllocation:
    """Sent with a rank's first piece of a model's shards: the storage to allocate for them, once."""

    token: int
    """The model's token (``ModelRoute.token``): the cell checks it got this delivery."""
    tensors: TensorLayout
    """Each shard's fqn, shape and dtype."""
    on_cpu: bool
    """CPU offload: the shards live in host memory even where the rank computes on a GPU."""


@dataclass(kw_only=True, slots=True)
class ControlRequest:
    """What the notebook wants the running cell to switch to, in the request file every rank reads."""

    version: int = 0
    """Bumped by each request: a rank acts on a version it has not seen."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Every live setting asked for so far in this cell (``config.LIVE_SETTINGS`` keys)."""
    cancel: bool = False
    """End the cell at the agreed step, as a finished one."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ControlRequest:
        return cls(**json.loads(text))


def control_file(directory: str | Path, run_id: int) -> Path:
    """The request file of cell ``run_id``, in the cluster's private directory."""
    return Path(directory, f"control-{run_id}.json")


def where_request(directory: str | Path) -> Path:
    """``%fsdp where``'s request: the number of the latest one, which every rank's watcher answers once."""
    return Path(directory, "where-request")


def where_answer(directory: str | Path, number: int, rank: int) -> Path:
    """Rank ``rank``'s answer to request ``number``: its stack and its ledger of collectives, as JSON."""
    return Path(directory, f"where-{number}-rank{rank}.json")


def debug_command_file(control: str | Path, rank: int) -> Path:
    """The line typed at rank ``rank``'s debugger prompt, beside the cell's control file: ``{"seq": n, "line": ...}``
    answering its n-th prompt (``nbfsdp.engines.debugging``)."""
    control = Path(control)
    return control.with_name(f"{control.stem}-debug-rank{rank}.json")


def claim_file(control: Path, version: int) -> Path:
    """The file whose first writer fixes the boundary at which request ``version`` applies on every rank."""
    return control.with_name(f"{control.stem}-v{version}.claim")


def control_files(control: Path) -> Iterator[Path]:
    """The request file and everything written beside it (partial writes, claims), to remove with the run.

    Matched by the exact stem: ``control-1`` leaves ``control-10``'s files alone.
    """
    yield from control.parent.glob(f"{control.stem}.*")
    yield from control.parent.glob(f"{control.stem}-v*")
    yield from control.parent.glob(f"{control.stem}-debug-*")


#: Starts rank 0's lines that draw a progress bar: an escape (APC) no user output starts with.
BAR_MARKER = "\x1b_nbfsdp-bar "


@dataclass(kw_only=True, slots=True)
class BarDrawing:
    """One drawing of a progress bar on rank 0, as one stderr line: ``BAR_MARKER``, the bar's id,
    ``live`` or ``end``, and the bar's text, space-separated."""

    bar: str
    """The bar's id, unique in the engine process."""
    ended: bool
    """The bar closed: this is its last state."""
    text: str
    """The bar as ``tqdm`` prints it, on one line."""

    def line(self) -> str:
        text = " ".join(self.text.splitlines())
        return f"{BAR_MARKER}{self.bar} {'end' if self.ended else 'live'} {text}\n"

    @classmethod
    def parse(cls, drawn: str) -> BarDrawing | None:
        """What follows ``BAR_MARKER`` on a line; None if it is not a drawing."""
        fields = drawn.split(" ", 2)
        if len(fields) != 3 or fields[1] not in ("live", "end"):
            return None
        return cls(bar=fields[0], ended=fields[1] == "end", text=fields[2])
