"""``%fsdp status``: the world and its ranks (host, local rank, engine, pid, threads, device), or an attached
cluster's engines before its first cell, printed. Runs in the kernel."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbfsdp.shared.collectives import size_text

if TYPE_CHECKING:
    from nbfsdp.kernel.cluster.attached import AttachedCluster
    from nbfsdp.kernel.run.session import Session


def status(session: Session) -> None:
    """The world and its ranks; while engines start in the background, that, without waiting."""
    cluster = session.cluster
    if (starting := cluster.starting) is not None:
        world_size, seconds = starting
        print(f"nbfsdp: starting {world_size} engines in the background (since {seconds:.1f} s)")
        return
    world = cluster.world
    attached = session.attached_cluster
    if attached is not None and (job := attached.job) is not None:
        state, reason = job.state()
        shown = f"{state} ({reason})" if reason and reason != "None" else state or "no longer in the queue"
        print(f"Slurm job {job.job_id}: {shown}, nodes {job.nodes() or '-'} (scancel {job.job_id} ends it)")
    if world is None and attached is not None:
        _attached_status(attached)
        return
    if world is None:
        failed = cluster.background_error
        why = f" (the background start failed: {failed}; the next cell starts again)" if failed else ""
        print(f"nbfsdp: no cluster running{why}")
        return
    print(
        f"world size {world.world_size}, backend {world.backend}, collective timeout {world.timeout:g}s: "
        f"{world.devices}{' (broken: restarts on the next cell)' if world.broken else ''}"
    )
    if world.devices.shared:
        share = world.devices.ranks_per_gpu
        print(
            f"GPU memory: each rank may allocate 1/{share} of its GPU ({share} ranks share one: "
            "torch.cuda.set_per_process_memory_fraction, so one rank cannot starve the others; --memory-limit "
            "SIZE sets another)"
        )
    if (saving := session.pending_save) is not None:
        print(f"saving {saving.path} in the background (`%fsdp wait` for it)")
    _models(session)
    hosts = cluster.rank_hosts()
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    print(f"hosts: {', '.join(f'{host} ({len(ranks)} ranks)' for host, ranks in by_host.items())}")
    width = max(len("host"), *map(len, hosts))
    print(f"{'rank':>4}  {'host':<{width}}  {'local':>5}  {'engine':>6}  {'pid':>7}  {'threads':>7}  device")
    for rank, (engine_id, info) in enumerate(zip(world.engine_ids, world.engines, strict=True)):
        local = by_host[hosts[rank]].index(rank)  # as LOCAL_RANK: ranks of a host are numbered from 0
        print(
            f"{rank:>4}  {hosts[rank]:<{width}}  {local:>5}  {engine_id:>6}  {info.pid:>7}  {info.threads:>7}"
            f"  {info.device}"
        )


def _attached_status(cluster: AttachedCluster) -> None:
    """An attached cluster before its first cell: its engines, each with the rank, host and local rank a
    cell using every engine would give it."""
    placements = cluster.placements_for(cluster.engines)
    engines = cluster.identities()
    hosts = len({p.host for p in placements})
    print(
        f"attached to {len(placements)} engines on {hosts} hosts (profile {cluster.profile}); no world yet: the "
        "next cell starts one"
    )
    width = max(len("host"), *(len(p.host) for p in placements))
    print(f"{'rank':>4}  {'host':<{width}}  {'local':>5}  {'engine':>6}  {'pid':>7}  {'gpus':>4}")
    for p in placements:
        info = engines[p.engine_id]
        print(f"{p.rank:>4}  {p.host:<{width}}  {p.local_rank:>5}  {p.engine_id:>6}  {info.pid:>7}  {info.gpus:>4}")


def _models(session: Session) -> None:
    """The notebook's models the world holds, and where each one's weights are."""
    from nbfsdp.kernel.run import residence

    named = {name: session.shell.user_ns.get(name) for name in session.engine_models()}
    lines = []
    for name, model in named.items():
        record = residence.of(model) if model is not None else None
        if record is None:
            lines.append(f"{name} (in the notebook too)")
        else:
            lines.append(f"{name} (on the ranks only: {size_text(record.nbytes)}, {record.history()})")
    if lines:
        print(f"models: {', '.join(lines)}")
