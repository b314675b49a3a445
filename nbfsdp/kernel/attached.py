"""A cluster nbfsdp did not start: ``%fsdp attach --profile P [--cluster-id ID]``.

The user started it (``ipcluster start --engines=ssh|slurm|mpi ...``), on this machine or spread over
several hosts; nbfsdp connects with ipyparallel's own files (``Cluster.from_file``), asks each engine
which host it is on, gives ranks host by host (``nbfsdp.kernel.hosts``) and makes the world's store a
TCPStore on rank 0's host, on the interface that reaches the controller. It never stops the cluster:
``%fsdp detach`` lets go of it, and ``%fsdp stop`` says so. It stands in for ``FSDPCluster`` in the
session while attached, with the same methods.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import ipyparallel as ipp
from IPython.core.error import UsageError
from IPython.core.profiledir import ProfileDir, ProfileDirError
from IPython.paths import get_ipython_dir

from nbfsdp.engines import engine, hosts
from nbfsdp.kernel.cluster import ENGINE_START_TIMEOUT, World, cpu_threads_per_rank, wait_for_death
from nbfsdp.kernel.hosts import Placement, place
from nbfsdp.shared.protocol import HostIdentity


class RegisteredEngine:
    """An engine of the attached cluster: alive while its controller has it registered (it notices a dead
    engine or host by its heartbeats); signals go through ipyparallel, which reaches other hosts."""

    def __init__(self, client: ipp.Client, engine_id: int, pid: int) -> None:
        self._client, self.engine_id, self.pid = client, engine_id, pid

    def alive(self) -> bool:
        return self.engine_id in self._client.ids

    def signal(self, signum: int) -> None:
        if self.alive():
            with contextlib.suppress(Exception):  # an engine without a nanny cannot be signalled this way
                self._client.send_signal(signum, targets=[self.engine_id], block=False)


class AttachedCluster:
    """The session's cluster while attached; see the module's docstring."""

    def __init__(self, profile: str | None, cluster_id: str | None) -> None:
        profile = profile or "default"
        if cluster_id is None:
            cluster_id = _only_cluster(profile)
        try:
            self._cluster = ipp.Cluster.from_file(profile=profile, cluster_id=cluster_id)
        except (OSError, ValueError) as error:
            raise UsageError(
                f"no running ipyparallel cluster in profile {profile} with cluster id {cluster_id!r}: {error}"
            ) from None
        self.client = self._cluster.connect_client_sync()
        self.profile, self.cluster_id = profile, cluster_id
        self._private_dir = tempfile.mkdtemp(prefix="nbfsdp-attached-")
        self._generation = 0
        self.world: World | None = None
        self.placements: list[Placement] = []
        self._identities: dict[int, HostIdentity] = {}
        self.background_error: BaseException | None = None
        self.starting = None

    # ------------------------------------------------------------ the session's view
    @property
    def private_dir(self) -> str:
        """Run control files for the ranks on this machine (ranks elsewhere do not see them)."""
        return self._private_dir

    @property
    def engines(self) -> int:
        return len(self.client.ids)

    def reuses_world(self, world_size: int, timeout: float) -> bool:
        return bool(self.world and self.world.serves(world_size, timeout))

    def placements_for(self, world_size: int) -> list[Placement]:
        """The ranks of a world of ``world_size``, host by host (each engine asked its host once)."""
        ids = sorted(self.client.ids)
        if not 1 <= world_size <= len(ids):
            raise UsageError(f"--world-size {world_size}: the attached cluster has {len(ids)} engines")
        if sorted(self._identities) != ids:
            found: list[HostIdentity] = self.client[ids].apply_sync(hosts.identity)
            self._identities = dict(zip(ids, found, strict=True))
        return place(self._identities, world_size)

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

    def ensure_world(self, world_size: int, timeout: float) -> World:
        """A world of ``world_size`` of the cluster's engines, host by host."""
        if self.reuses_world(world_size, timeout):
            return self.world
        self.placements = self.placements_for(world_size)
        first = self.placements[0].engine_id
        rendezvous = self.client[first].apply_sync(hosts.open_rendezvous, self._controller_address())
        self._generation += 1
        threads = cpu_threads_per_rank(max(p.local_world_size for p in self.placements))
        results = [
            self.client[p.engine_id].apply_async(
                engine.setup,
                rank=p.rank,
                world_size=world_size,
                backend="gloo",
                store_path=None,
                timeout=timeout,
                threads=threads,
                generation=self._generation,
                rendezvous=tuple(rendezvous),
                environment=p.environment(world_size),
            )
            for p in self.placements
        ]
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        infos = [result.get(timeout=max(1.0, deadline - time.monotonic())) for result in results]
        processes: list[Any] = [
            RegisteredEngine(self.client, p.engine_id, info.pid) for p, info in zip(self.placements, infos, strict=True)
        ]
        engine_ids = [p.engine_id for p in self.placements]
        self.world = World(world_size, "gloo", timeout, self._generation, engine_ids, infos, processes=processes)
        return self.world

    def dead_ranks(self) -> dict[int, str]:
        """Ranks whose engine the controller no longer has, named with their host."""
        world = self.world
        if world is None:
            return {}
        return {
            rank: f"engine {world.engine_ids[rank]} on {self.placements[rank].host} is gone (unregistered)"
            for rank, process in enumerate(world.processes)
            if not process.alive()
        }

    def how_rank_died(self, rank: int, within: float = 2.0) -> str | None:
        return wait_for_death(self.dead_ranks, rank, within)

    def signal_ranks(self, ranks: list[int], signum: int) -> None:
        for rank in ranks:
            self.world.processes[rank].signal(signum)

    def kill_engines(self) -> None:
        """A stuck world is given up, its engines interrupted: they are not nbfsdp's to kill."""
        if self.world:
            self.signal_ranks(list(range(self.world.world_size)), signal.SIGINT)
        self.world = None

    def stop(self) -> None:
        raise UsageError(
            "nbfsdp did not start this cluster (it is attached): `%fsdp detach` lets go of it and leaves it "
            "running; stop it where it was started (ipcluster stop)"
        )

    def detach(self) -> None:
        """Let go of the cluster, which goes on running."""
        self.world = None
        self.client.close()
        shutil.rmtree(self._private_dir, ignore_errors=True)

    def start_in_background(self, world_size: int, timeout: float, since: float | None = None) -> None:
        """Nothing to start: the cluster runs already."""

    # ----------------------------------------------------------------- helpers
    def _controller_address(self) -> str:
        """The address the engines reach the controller at: the network the hosts share."""
        address = self._cluster.controller_ip or ""
        if address in ("", "*", "0.0.0.0"):
            address = self._cluster.controller_location or "127.0.0.1"
        return address


def _only_cluster(profile: str) -> str:
    """The id of the one cluster running in ``profile`` (its ``security/cluster-<id>.json``)."""
    try:
        directory = ProfileDir.find_profile_dir_by_name(get_ipython_dir(), profile)
    except ProfileDirError:
        raise UsageError(f"no ipyparallel profile {profile!r} in {get_ipython_dir()}") from None
    found = sorted(p.name[len("cluster-") : -len(".json")] for p in Path(directory.security_dir).glob("cluster-*.json"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise UsageError(f"no running ipyparallel cluster in profile {profile}: start one with ipcluster start")
    raise UsageError(f"profile {profile} has several clusters running ({', '.join(found)}): pass --cluster-id")
