"""What every cluster shares: the world it runs, the ``Cluster`` Protocol the session drives, and the
decisions a world's start makes (where its ranks run, their threads, NCCL's view of ranks sharing a GPU).

Importing this module loads neither torch nor ipyparallel.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from nbfsdp.shared.devices import Devices, choose, gpu_capability
from nbfsdp.shared.processes import ProcessRef

if TYPE_CHECKING:
    import ipyparallel as ipp

    from nbfsdp.kernel.cluster.hosts import Placement
    from nbfsdp.shared.protocol import EngineInfo

#: The notebook's cluster, which ``planned_devices`` asks (set by the session as it changes).
_notebook_cluster: Cluster | None = None
#: How long a world's engines may take to set up their process group.
ENGINE_START_TIMEOUT = 120.0


@dataclass
class RunningWorld:
    """A running world: which engine is which rank, and on what."""

    world_size: int
    backend: str
    timeout: float
    generation: int
    engine_ids: list[int]  # by rank
    devices: Devices
    engines: list[EngineInfo] = field(default_factory=list)  # by rank
    broken: bool = False
    processes: list[ProcessRef] = field(default_factory=list)
    """The engine processes by rank, as they were started: what signals reach."""

    @property
    def pids(self) -> list[int]:
        return [e.pid for e in self.engines]

    def serves(self, world_size: int, timeout: float, devices: Devices) -> bool:
        """A cell of this world size, timeout and devices can run in it as it is."""
        return (
            not self.broken
            and self.world_size == world_size
            and self.timeout == timeout
            and engine_layout(self.devices) == engine_layout(devices)
        )


@dataclass(frozen=True)
class WorldPlan:
    """Where a cell's world runs, as its cluster decided once for the cell (``Cluster.plan_world``), carried
    through the cell's steps so that none asks again (an attached cluster's ask places its engines anew)."""

    world_size: int
    timeout: float
    devices: Devices
    reuses: bool
    """The running world serves the cell as it is: nothing is restarted."""
    placements: tuple[Placement, ...] = ()
    """An attached cluster's ranks, host by host (``nbfsdp.kernel.cluster.hosts.place``); nbfsdp's own has none."""


def engine_layout(devices: Devices) -> tuple[str, int, tuple[int, ...]]:
    """What the engines of a world depend on: where they run, not why."""
    return devices.type, devices.world_size, devices.rank_gpus


def wait_for_death(dead_ranks: Callable[[], dict[int, str]], rank: int, within: float) -> str | None:
    """How ``rank``'s engine ended (``dead_ranks()``'s word), waiting up to ``within`` seconds to see it end:
    a controller can report a death while the process is still tearing down, or its host still unregistering."""
    deadline = time.monotonic() + within
    while (how := dead_ranks().get(rank)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return how


def visible_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def devices_here(world_size: int, requested: str | None, *, planning: bool = False) -> Devices:
    """Where ``world_size`` ranks started from this kernel run, asked ``requested`` (None: not given);
    ``planning``: a plan for GPUs this machine may not have (``%fsdp explain --device cuda``)."""
    gpus = visible_gpus()
    return choose(requested, world_size, gpus, planning=planning, capability=gpu_capability() if gpus else None)


def planned_devices(world_size: int, requested: str | None) -> Devices:
    """Where a plan's ``world_size`` ranks, asked ``requested``, would run: as the notebook's cluster
    decides (an attached one from its engines' GPUs), else as this machine would; GPUs it lacks are
    planned for (``%fsdp explain --device cuda`` from a kernel without one)."""
    cluster = _notebook_cluster
    if cluster is None:
        return devices_here(world_size, requested, planning=True)
    return cluster.devices(world_size, requested, planning=True)


def plan_with(cluster: Cluster | None) -> None:
    """``cluster`` is the notebook's now (the session's own, or one it attached to): plans ask it."""
    global _notebook_cluster
    _notebook_cluster = cluster


def nccl_host_environment(devices: Devices, rank: int, key: str) -> dict[str, str]:
    """What a rank sets before ``init_process_group`` so that NCCL accepts ranks that share a GPU: an
    ``NCCL_HOSTID`` per "host" of ``Devices.nccl_hosts``, made unique to this cluster by ``key`` (NCCL
    hashes it with nothing else). Nothing where every rank has a GPU of its own."""
    if not devices.shared:
        return {}
    return {"NCCL_HOSTID": f"nbfsdp-{os.path.basename(key)}-{devices.nccl_hosts[rank]}"}


def run_id(private_dir: str, generation: int) -> str:
    """The world's ``TORCHELASTIC_RUN_ID``: one per world of this cluster, as torchrun's ``--rdzv-id`` is one
    per job."""
    return f"nbfsdp-{os.path.basename(private_dir)}-{generation}"


def cpu_threads_per_rank(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // world_size)


class Cluster(Protocol):
    """The cluster the session runs cells on: nbfsdp's own (``FSDPCluster``) or one it attached to
    (``nbfsdp.kernel.cluster.attached.AttachedCluster``). The session, the runner and delivery use only this;
    what only an attached cluster has (its engines, hosts, profile) is asked of ``Session.attached_cluster``."""

    world: RunningWorld | None
    """The running world; None before the first and after ``kill_engines`` or ``stop``."""
    background_error: BaseException | None
    """Why the last background start failed, for ``%fsdp status`` (the next ``ensure_world`` starts again)."""

    @property
    def client(self) -> ipp.Client:
        """The ipyparallel client that reaches the engines."""

    @property
    def private_dir(self) -> str:
        """Where the notebook and the ranks meet: run control files, interval-save markers."""

    @property
    def starting(self) -> tuple[int, float] | None:
        """While a background start runs: its world size and the seconds since it began. Never waits."""

    def start_in_background(self, world_size: int, timeout: float, since: float | None = None) -> None:
        """Start the world ``plan_world(world_size, timeout)`` plans, without waiting (nothing, where it runs)."""

    def plan_world(self, world_size: int, timeout: float, device: str | None = None) -> WorldPlan:
        """Where a world of ``world_size`` ranks on ``device`` (None: not given) runs, and whether the running
        world serves it: asked once a cell."""

    def ensure_world(self, plan: WorldPlan) -> RunningWorld:
        """A healthy world as ``plan`` says, reusing what already runs."""

    def unsteerable(self) -> str | None:
        """Why a cell cannot be steered mid-run (live changes, cancel, interval saves), or None."""

    def devices(self, world_size: int, device: str | None = None, *, planning: bool = False) -> Devices:
        """Where a world of ``world_size`` runs, asked ``device`` (``--device``; None: not given): on GPUs
        (NCCL) or the CPU (gloo). A device it cannot have raises ``ConfigError``, unless ``planning`` (a plan,
        nothing run) where it can plan for it."""

    def default_world_size(self, device: str | None = None) -> int:
        """The world size of a cell that gives none, asked ``device``: a rank per GPU where the ranks would
        have GPUs, else 2 (an attached cluster: every engine)."""

    def rank_hosts(self) -> list[str]:
        """The running world's host per rank (names unique per host, even where hostnames are not)."""

    def dead_ranks(self) -> dict[int, str]:
        """Ranks of the running world whose engine has ended, with how."""

    def how_rank_died(self, rank: int, within: float = 2.0) -> str | None:
        """How the rank's engine ended, waiting up to ``within`` seconds to see it end; None while it runs."""

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        """Signal the engines of these ranks of the running world (those that ended are skipped)."""

    def kill_engines(self) -> None:
        """Give up the running world now, even one stuck in a collective (nbfsdp's own engines are killed,
        an attached cluster's interrupted); the next world starts afresh."""

    def stop(self) -> None:
        """End the cluster (an attached one refuses: UsageError, it is not nbfsdp's to stop)."""
