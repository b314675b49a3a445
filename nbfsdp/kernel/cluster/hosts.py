"""Ranks given host by host, as torchrun gives them: the ranks of one host are consecutive, and each
engine learns the variables torchrun sets for a worker (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...), so a script written for torchrun finds them in a cell.

An HSDP mesh ``(replicate, shard)`` is row-major, so sharding inside a host needs exactly that:
ranks ``[r * S, (r + 1) * S)`` on one host. The engines say which host they are on
(``nbfsdp.engines.hosts``); hosts come in the order their first engine registered.
"""

from __future__ import annotations

from dataclasses import dataclass

from nbfsdp.shared.config import ConfigError
from nbfsdp.shared.devices import Devices, plural, requested_device
from nbfsdp.shared.protocol import HostIdentity


@dataclass(frozen=True, slots=True)
class Placement:
    """One rank: the engine it runs on, its host, and its place there."""

    rank: int
    engine_id: int
    host: str
    """The host's name (its hostname; made unique where two hosts share one)."""
    local_rank: int
    local_world_size: int
    group_rank: int = 0
    """The host's place among the world's hosts (torchrun's node rank)."""

    def environment(self, world_size: int, hosts: int, rendezvous: tuple[str, int], run_id: str) -> dict[str, str]:
        """What torchrun sets for this rank's worker, in a world of ``hosts`` hosts whose store listens at
        ``rendezvous`` (``MASTER_ADDR``, ``MASTER_PORT``). One role ("default"), never restarted: torchrun's
        values for ``torchrun --nnodes H --nproc-per-node L`` without ``--max-restarts``."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(hosts),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": rendezvous[0],
            "MASTER_PORT": str(rendezvous[1]),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
        }


def one_host(world_size: int) -> list[Placement]:
    """Every rank on this machine (nbfsdp's own cluster): rank ``r`` is engine ``r``'s, local rank ``r``."""
    return [Placement(rank, rank, "", rank, world_size) for rank in range(world_size)]


def place(engines: dict[int, HostIdentity], world_size: int) -> list[Placement]:
    """The first ``world_size`` ranks over these engines (by engine id), host by host.

    Hosts are taken whole, in the order of their lowest engine id, so a subset fills hosts one after
    another; within a host, engines go by id (a GPU each, in order). Engines a Slurm step started go by
    ``SLURM_PROCID`` instead, so that each rank is Slurm's task of that number (and, Slurm laying tasks out in
    blocks, its local rank ``SLURM_LOCALID``)."""
    if world_size > len(engines):
        raise ValueError(f"{world_size} ranks asked for, {len(engines)} engines in the cluster")
    procids = {engine_id: identity.slurm_procid for engine_id, identity in engines.items()}
    order = sorted(engines)
    if all(procid is not None for procid in procids.values()):
        order = sorted(engines, key=lambda engine_id: procids[engine_id] or 0)
    by_host: dict[str, list[int]] = {}
    for engine_id in order:
        by_host.setdefault(engines[engine_id].key, []).append(engine_id)
    names = _host_names({key: engines[ids[0]].hostname for key, ids in by_host.items()})
    chosen: list[tuple[str, list[int]]] = []
    left = world_size
    for key, ids in by_host.items():
        if left == 0:
            break
        chosen.append((key, ids[:left]))
        left -= len(chosen[-1][1])
    placements: list[Placement] = []
    for group_rank, (key, ids) in enumerate(chosen):
        for local_rank, engine_id in enumerate(ids):
            placements.append(Placement(len(placements), engine_id, names[key], local_rank, len(ids), group_rank))
    return placements


def devices(placements: list[Placement], engines: dict[int, HostIdentity], requested: str | None) -> Devices:
    """Where the ranks of these placements run, asked ``requested`` (``--device``; None: not given).

    ``auto``: on GPUs (NCCL) where every rank has one of its own (its host's GPU ``LOCAL_RANK``, as under
    torchrun), on the CPU (gloo) where no engine sees one; hosts short of GPUs beside hosts with enough are
    a ConfigError naming each, with its ranks and GPUs. ``cuda``: every rank on a GPU of its host, local rank
    ``l`` on GPU ``l mod G`` (several to a GPU where the host has fewer GPUs than ranks); a host without any
    is a ConfigError naming it. ``cpu``: gloo. Where a launcher bound each engine of a host to GPUs of its own
    (Slurm's ``--gpus-per-task``, ``--gpu-bind``: each sees other GPUs), every rank there takes the first it sees."""
    world_size = len(placements)
    requested = requested_device(requested)
    gpus = {p.engine_id: engines[p.engine_id].gpus for p in placements}
    if requested == "cpu" or (requested == "auto" and not any(gpus.values())):
        return Devices("cpu", world_size)
    bound = _bound_hosts(placements, engines)
    short = {
        p.host: (p.local_world_size, gpus[p.engine_id])
        for p in placements
        if gpus[p.engine_id] < (p.local_world_size if requested == "auto" and p.host not in bound else 1)
    }
    if short:
        listed = ", ".join(
            f"{host} has {plural(ranks, 'rank')} and {plural(count, 'GPU')}" for host, (ranks, count) in short.items()
        )
        rule = "every rank needs a GPU of its own, or none has one" if requested == "auto" else "--device cuda"
        raise ConfigError(f"{rule}: {listed}")
    per_host = {
        p.host: p.local_world_size if p.host in bound else min(gpus[p.engine_id], p.local_world_size)
        for p in placements
    }
    shared = any(p.local_world_size > per_host[p.host] for p in placements)
    capabilities = [engines[p.engine_id].capability for p in placements]
    return Devices(
        "cuda",
        world_size,
        sum(per_host.values()),
        rank_gpus=tuple(0 if p.host in bound else p.local_rank % per_host[p.host] for p in placements),
        nccl_hosts=tuple(f"{p.host}-{p.local_rank // per_host[p.host]}" for p in placements) if shared else (),
        capability=min((c for c in capabilities if c is not None), default=None),  # the oldest GPU decides
    )


def _bound_hosts(placements: list[Placement], engines: dict[int, HostIdentity]) -> set[str]:
    """The hosts whose engines each see GPUs no other engine of that host sees (``CUDA_VISIBLE_DEVICES`` lists
    that do not meet, as Slurm binds a task's GPUs): their ranks own what they see."""
    seen: dict[str, list[set[str]]] = {}
    for p in placements:
        visible = engines[p.engine_id].visible_gpus
        listed = {gpu for gpu in (visible or "").split(",") if gpu}
        seen.setdefault(p.host, []).append(listed if visible is not None and engines[p.engine_id].gpus else set())
    return {
        host
        for host, sets in seen.items()
        if len(sets) > 1 and all(sets) and sum(len(s) for s in sets) == len(set().union(*sets))
    }


def _host_names(hostnames: dict[str, str]) -> dict[str, str]:
    """A name per host key: its hostname, with ``#2``, ``#3`` ... where hosts share one."""
    names: dict[str, str] = {}
    seen: dict[str, int] = {}
    for key, hostname in hostnames.items():
        seen[hostname] = seen.get(hostname, 0) + 1
        names[key] = hostname if seen[hostname] == 1 else f"{hostname}#{seen[hostname]}"
    return names
