"""Where a plan's ranks sit: the device mesh's groups over ranks, and what crosses between hosts.

A ring collective over a group sends, on each link whose two ends are on different hosts, what one rank sends;
summed per host, that is what the host's network cards carry (``Plan.cross_host``), and what the cost model
times at their bandwidth. Runs in the kernel; shared by the plan and the cost model.
"""

from __future__ import annotations


def shard_groups(replicas: int, shards: int) -> list[list[int]]:
    """The all-gather and reduce-scatter groups: rows of the row-major (replicate, shard) mesh."""
    return [list(range(r * shards, (r + 1) * shards)) for r in range(replicas)]


def replicate_groups(replicas: int, shards: int) -> list[list[int]]:
    """The all-reduce groups: columns of the mesh."""
    return [list(range(s, replicas * shards, shards)) for s in range(shards)]


def host_out(groups: list[list[int]], hosts: list[str], sent: int) -> dict[str, int]:
    """Bytes each host sends to other hosts: in each group's ring (ranks in order), every link whose
    two ends are on different hosts carries what one rank sends."""
    out = dict.fromkeys(hosts, 0)
    for group in groups:
        if len(group) > 1:
            for a, b in zip(group, group[1:] + group[:1], strict=True):
                if hosts[a] != hosts[b]:
                    out[hosts[a]] += sent
    return out


def cross_host(wire: dict[str, dict[str, int]], mesh: tuple[int, int], hosts: list[str]) -> dict[str, dict[str, int]]:
    """Per collective, the bytes each host sends to the others per step (``Plan.cross_host``)."""
    replicas, shards = mesh
    mesh_groups = {"shard": shard_groups(replicas, shards), "replicate": replicate_groups(replicas, shards)}
    out = {
        kind: host_out(
            mesh_groups["replicate" if kind == "all_reduce" else "shard"],
            hosts,
            w["sent"] - w.get("post_forward_sent", 0),
        )
        for kind, w in wire.items()
    }
    gathers = wire.get("all_gather", {})
    if gathers.get(
        "post_forward_group"
    ):  # backward's gathers: inside groups of N consecutive ranks (FSDP2's view(-1, N))
        group = gathers["post_forward_group"]
        inside = host_out(shard_groups(len(hosts) // group, group), hosts, gathers["post_forward_sent"])
        out["all_gather"] = {host: out["all_gather"][host] + inside[host] for host in hosts}
    return out
