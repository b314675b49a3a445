"""A cluster nbfsdp did not start: ``%fsdp attach --profile P [--cluster-id ID]``.

The user started it (``ipcluster start --engines=ssh|slurm|mpi ...``), on this machine or spread over
several hosts; nbfsdp connects with ipyparallel's own connection files, asks each engine
which host it is on, gives ranks host by host (``nbfsdp.kernel.cluster.hosts``) and makes the world's store a
TCPStore on rank 0's host, on the interface that reaches the controller. It never stops the cluster:
``%fsdp detach`` lets go of it, and ``%fsdp stop`` says so. While attached it is the session's
``Cluster`` (``nbfsdp.kernel.cluster.local``), as ``FSDPCluster`` is otherwise.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp
from IPython.core.error import UsageError
from IPython.core.profiledir import ProfileDir, ProfileDirError
from IPython.paths import get_ipython_dir

from nbfsdp.engines import engine, hosts
from nbfsdp.kernel.cluster import ipyparallel_private
from nbfsdp.kernel.cluster.hosts import Placement, devices, place
from nbfsdp.kernel.cluster.lifelines import Lifelines
from nbfsdp.kernel.cluster.rank_calls import set_up_every_rank
from nbfsdp.kernel.cluster.world import (
    RunningWorld,
    WorldPlan,
    cpu_threads_per_rank,
    nccl_host_environment,
    run_id,
    wait_for_death,
)
from nbfsdp.shared.config import ConfigError
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.network import source_address
from nbfsdp.shared.protocol import HostIdentity, WorldSetup

if TYPE_CHECKING:
    from nbfsdp.kernel.cluster.slurm import SlurmJob

#: What attaching to a controller on the network without CurveZMQ prints (one line).
CURVE_WARNING = (
    "nbfsdp: warning: the controller listens on {address} without encrypting or authenticating connections; "
    "start ipcluster with IPP_ENABLE_CURVE=1 set to turn CurveZMQ on"
)

#: A file in the shared directory that engines look for, holding the attach's secret: they see it or not.
SEEN_FILE = "seen-by-the-hosts"


class RegisteredEngine:
    """An engine of the attached cluster: alive while its lifeline to the kernel holds and its controller
    has it registered; signals go through ipyparallel, which reaches other hosts."""

    def __init__(self, cluster: AttachedCluster, engine_id: int, pid: int) -> None:
        self._cluster, self._client, self.engine_id, self.pid = cluster, cluster.client, engine_id, pid

    def alive(self) -> bool:
        return self._cluster.how_engine_ended(self.engine_id) is None

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(Exception):  # an engine without a nanny cannot be signalled this way
                self._client.send_signal(signum, targets=[self.engine_id], block=False)


class AttachedCluster:
    """The session's cluster while attached; see the module's docstring."""

    def __init__(self, profile: str | None, cluster_id: str | None, shared_dir: str | None = None) -> None:
        profile = profile or "default"
        directory = _profile_dir(profile)
        if cluster_id is None:
            cluster_id = _only_cluster(directory, profile)
        try:
            running = cluster_id in ipyparallel_private.running_cluster_ids(directory.security_dir)
            self._engine_connection = ipyparallel_private.read_engine_connection(  # a controller just started
                directory.security_dir, cluster_id, wait_s=10.0 if running else 0.0
            )
            self.client = ipp.Client(profile_dir=directory.location, cluster_id=cluster_id)
        except (OSError, ValueError) as error:
            raise UsageError(
                f"no running ipyparallel cluster in profile {profile} with cluster id {cluster_id!r}: {error}"
            ) from None
        self.profile, self.cluster_id = profile, cluster_id
        self._lifelines = Lifelines(source_address(self._controller_address()))
        self._warn_without_curve()
        # where the notebook and the ranks meet to steer a cell (live changes, cancel, interval saves): the
        # profile's directory, which the hosts of a Slurm or PBS cluster share, unless the user names one
        parent = Path(shared_dir or Path(directory.location, "nbfsdp")).expanduser().resolve()
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self._private_dir = tempfile.mkdtemp(prefix="attached-", dir=parent)  # mode 0700
        except OSError as error:
            self._lifelines.close()
            self.client.close()
            raise UsageError(f"--shared-dir {parent}: {error.strerror or error}") from None
        Path(self._private_dir, SEEN_FILE).write_text(self._lifelines.secret)
        self._sees_private_dir: dict[int, bool] = {}
        self._generation = 0
        self.world: RunningWorld | None = None
        self.placements: list[Placement] = []
        self._identities: dict[int, HostIdentity] = {}
        self.background_error: BaseException | None = None
        self.starting: tuple[int, float] | None = None  # never: there is nothing to start
        self.job: SlurmJob | None = None
        """The Slurm job nbfsdp started the engines as (``%fsdp attach --slurm``), which ``stop`` cancels."""
        if self.engines:  # every engine checks in now: its host, whether it sees the directory, its lifeline
            try:
                self.placements = self.placements_for(self.engines)
            except BaseException:  # an engine that cannot check in: let go of all this attach opened
                self.detach()
                raise

    def summary(self) -> list[str]:
        """What ``%fsdp attach`` says: the engines per host, and why cells cannot be steered, if so."""
        counts: dict[str, int] = {}
        for placement in self.placements:
            counts[placement.host] = counts.get(placement.host, 0) + 1
        hosts = ", ".join(f"{host} {count}" for host, count in counts.items())
        lines = [f"attached to {len(self.placements)} engines on {len(counts)} hosts ({hosts}); `%fsdp status`"]
        if why := self.unsteerable():
            lines.append(f"warning: {why}")
        return lines

    # ------------------------------------------------------------ the session's view
    @property
    def private_dir(self) -> str:
        """Where the cells' run control files go: a directory the hosts share, if they do (``unsteerable``)."""
        return self._private_dir

    def unsteerable(self) -> str | None:
        """Why a cell cannot be steered mid-run: the hosts that do not see ``private_dir``."""
        blind = sorted({p.host for p in self.placements if not self._sees_private_dir.get(p.engine_id)})
        if not blind:
            return None
        return (
            f"live changes, cancel and --save-interval need a directory the notebook and every host share; "
            f"{', '.join(blind)} {'does' if len(blind) == 1 else 'do'} not see {self._private_dir}: attach with "
            "`%fsdp attach --shared-dir PATH` (a path on a shared file system)"
        )

    @property
    def engines(self) -> int:
        """Engines a world can use: registered, and not known to have ended."""
        return len(self._usable_ids())

    def how_engine_ended(self, engine_id: int) -> str | None:
        """How an engine ended (its lifeline or its registration), or None while it runs."""
        if engine_id not in self.client.ids:
            return "unregistered from the controller"
        return self._lifelines.lost().get(engine_id)

    def _usable_ids(self) -> list[int]:
        lost = self._lifelines.lost()
        return sorted(i for i in self.client.ids if i not in lost)

    def plan_world(self, world_size: int, timeout: float, device: str | None = None) -> WorldPlan:
        """Where a world of ``world_size`` runs (its engines placed once), and whether the running world serves it;
        a device some host cannot have is a UsageError naming each."""
        placements = self.placements_for(world_size)
        try:
            chosen = devices(placements, self._identities, device)
        except ConfigError as error:
            raise UsageError(str(error)) from None
        serves = bool(self.world and self.world.serves(world_size, timeout, chosen))
        return WorldPlan(world_size, timeout, chosen, serves, tuple(placements))

    def placements_for(self, world_size: int) -> list[Placement]:
        """The ranks of a world of ``world_size``, host by host (each engine asked its host once)."""
        ids = self._usable_ids()
        self._say_if_job_over(len(ids), world_size)
        if not 1 <= world_size <= len(ids):
            raise UsageError(f"--world-size {world_size}: the attached cluster has {len(ids)} engines")
        self._identities = {i: self._identities[i] for i in ids if i in self._identities}
        new = [i for i in ids if i not in self._identities]
        lifeline = self._lifelines.address, self._lifelines.secret
        seen = str(Path(self._private_dir, SEEN_FILE))
        arguments = {i: (*lifeline, i, seen) for i in new}
        for engine_id, answer in set_up_every_rank(self.client, {i: i for i in new}, hosts.check_in, arguments).items():
            self._identities[engine_id], self._sees_private_dir[engine_id] = answer
        return place(self._identities, world_size)

    def _say_if_job_over(self, usable: int, wanted: int) -> None:
        """Fewer engines than wanted, of a Slurm job that has ended: a UsageError in Slurm's word for how."""
        if self.job is not None and usable < wanted and (ended := self.job.ended()):
            raise UsageError(
                f"Slurm job {self.job.job_id} is over ({ended}): its engines are gone; `%fsdp attach --slurm ...` "
                "starts another"
            )

    def identities(self) -> dict[int, HostIdentity]:
        """What each engine said of itself when it checked in (its host, pid and GPUs), by engine id."""
        return dict(self._identities)

    def rank_hosts(self) -> list[str]:
        return [p.host for p in self.placements] if self.world else []

    def devices(self, world_size: int, device: str | None = None, *, planning: bool = False) -> Devices:
        """Where a world this size runs, from the GPUs each engine sees (``nbfsdp.kernel.cluster.hosts.devices``);
        hosts that cannot have the device asked are a ConfigError naming each (``planning`` too: the engines
        are there to ask)."""
        return devices(self.placements_for(world_size), self._identities, device)

    def default_world_size(self, device: str | None = None) -> int:
        """Every engine of the cluster."""
        ids = self._usable_ids()
        self._say_if_job_over(len(ids), len(self.client.ids) or 1)
        return len(ids)

    def host_replicas(self, world_size: int) -> int:
        """HYBRID_SHARD's replicas across hosts: one per host, each host sharding the model among its ranks.
        Hosts with different numbers of ranks cannot: a UsageError names them."""
        counts: dict[str, int] = {}
        for placement in self.placements_for(world_size):
            counts[placement.host] = counts.get(placement.host, 0) + 1
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{host} {count}" for host, count in counts.items())
            raise UsageError(
                f"HYBRID_SHARD across hosts needs as many ranks on every host; at world size {world_size} the "
                f"hosts have {listed}: choose --world-size to fill hosts evenly, or --replicas R yourself"
            )
        return len(counts)

    def ensure_world(self, plan: WorldPlan) -> RunningWorld:
        """A world of the cluster's engines as ``plan`` placed them, host by host."""
        if self.world is not None and self.world.serves(plan.world_size, plan.timeout, plan.devices):
            return self.world
        world_size, timeout, chosen = plan.world_size, plan.timeout, plan.devices
        self.placements = list(plan.placements)
        first = self.placements[0].engine_id
        rendezvous = self.client[first].apply_sync(hosts.open_rendezvous, self._controller_address())
        self._generation += 1
        threads = cpu_threads_per_rank(max(p.local_world_size for p in self.placements))
        host_count = self.placements[-1].group_rank + 1
        joining = {
            p.rank: (
                WorldSetup(
                    rank=p.rank,
                    world_size=world_size,
                    backend=chosen.backend,
                    timeout=timeout,
                    threads=threads,
                    generation=self._generation,
                    rendezvous=tuple(rendezvous),
                    environment={
                        **p.environment(
                            world_size, host_count, tuple(rendezvous), run_id(self._private_dir, self._generation)
                        ),
                        **nccl_host_environment(chosen, p.rank, self._private_dir),
                    },
                    gpu=chosen.rank_gpus[p.rank] if chosen.type == "cuda" else None,
                    where_dir=self._private_dir if self._sees_private_dir.get(p.engine_id) else None,
                ),
            )
            for p in self.placements
        }
        rank_engines = {p.rank: p.engine_id for p in self.placements}
        answers = set_up_every_rank(self.client, rank_engines, engine.setup, joining)
        infos = [answers[p.rank] for p in self.placements]
        processes: list[Any] = [
            RegisteredEngine(self, p.engine_id, info.pid) for p, info in zip(self.placements, infos, strict=True)
        ]
        engine_ids = [p.engine_id for p in self.placements]
        self.world = RunningWorld(
            world_size, chosen.backend, timeout, self._generation, engine_ids, chosen, infos, processes=processes
        )
        return self.world

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine the controller no longer has, named with their host."""
        world = self.world
        if world is None:
            return {}
        ended = {rank: self.how_engine_ended(engine_id) for rank, engine_id in enumerate(world.engine_ids)}
        return {
            rank: f"engine {world.engine_ids[rank]} on {self.placements[rank].host}: {how}"
            for rank, how in ended.items()
            if how is not None
        }

    def how_rank_died(self, rank: int, within: float = 2.0) -> str | None:
        return wait_for_death(self.dead_ranks, rank, within)

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        assert self.world is not None, "no world running"
        for rank in ranks:
            self.world.processes[rank].signal(signum)

    def kill_engines(self) -> None:
        """A stuck world is given up, its engines not killed (they are not nbfsdp's) but told on their lifelines
        to release it: a rank waiting in a collective for a dead host's ranks, which the runner's SIGINT
        cannot wake, ends it at once (``nbfsdp.engines.release``) and takes the next cell's set-up."""
        if self.world:
            self._lifelines.release(self.world.engine_ids, self.world.generation)
        self.world = None

    def stop(self) -> None:
        """A cluster nbfsdp started as a Slurm job (``job``) ends with it; any other is not nbfsdp's to stop."""
        if self.job is None:
            raise UsageError(
                "nbfsdp did not start this cluster (it is attached): `%fsdp detach` lets go of it and leaves it "
                "running; stop it where it was started (ipcluster stop)"
            )
        self.detach()
        self.job.stop()

    def detach(self) -> None:
        """Let go of the cluster, which goes on running."""
        self.world = None
        self.client.close()
        self._lifelines.close()
        shutil.rmtree(self._private_dir, ignore_errors=True)

    def start_in_background(self, world_size: int, timeout: float, since: float | None = None) -> None:
        """Nothing to start: the cluster runs already."""

    # ----------------------------------------------------------------- helpers
    def _warn_without_curve(self) -> None:
        """One line where the controller takes engines from beyond loopback without CurveZMQ: ipyparallel's
        own engine connection file says where it listens and whether it has a CurveZMQ key."""
        address = self._engine_connection.get("interface", "").split("://")[-1]
        if self._engine_connection.get("curve_serverkey") or not address:
            return
        try:
            loopback = ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
        except (OSError, ValueError):  # "*", or a name that does not resolve here
            loopback = False
        if not loopback:
            print(CURVE_WARNING.format(address=address), file=sys.stderr)

    def _controller_address(self) -> str:
        """The address the engines reach the controller at (its engine connection file): the network the
        hosts share."""
        address = self._engine_connection.get("interface", "").split("://")[-1]
        if address in ("", "*", "0.0.0.0"):
            address = self._engine_connection.get("location") or "127.0.0.1"
        return address


def _profile_dir(profile: str) -> ProfileDir:
    try:
        return ProfileDir.find_profile_dir_by_name(get_ipython_dir(), profile)
    except ProfileDirError:
        raise UsageError(f"no ipyparallel profile {profile!r} in {get_ipython_dir()}") from None


def _only_cluster(directory: ProfileDir, profile: str) -> str:
    """The id of the one cluster running in ``profile``."""
    found = ipyparallel_private.running_cluster_ids(directory.security_dir)
    if len(found) == 1:
        return found[0]
    if not found:
        raise UsageError(f"no running ipyparallel cluster in profile {profile}: start one with ipcluster start")
    raise UsageError(f"profile {profile} has several clusters running ({', '.join(found)}): pass --cluster-id")
