"""Each rank's shards of the notebook's models, delivered in bounded pieces before the cell runs.

Sent inside the cell's own message, a rank would hold its whole shard as
received while FSDP2 allocated its storage beside it: twice the shard at the
peak. Here each rank first allocates the storage its shards keep for good,
then receives them a piece (``transfer.piece_bytes``) at a time, every piece copied in
and freed before the next is sent: the peak is the shard plus one piece. The
pieces are views of the notebook's own tensors, sent by ipyparallel without a
copy, so the notebook's memory barely moves either.
"""

from __future__ import annotations

import ipyparallel as ipp
import torch.nn as nn
from ipyparallel import error as ipp_error

from nbfsdp.engines import engine
from nbfsdp.kernel.cluster import Cluster, World
from nbfsdp.kernel.runner import LIVENESS_SECONDS, RankError
from nbfsdp.shared import transfer
from nbfsdp.shared.protocol import ShardAllocation


def deliver(
    cluster: Cluster,
    world: World,
    models: dict[str, nn.Module],
    tokens: dict[str, int],
    shard_degree: int,
    on_cpu: bool,
) -> list[int]:
    """Send every rank its shards of ``models``; the bytes each rank received, as it counted them.

    Rank r gets shard ``r % shard_degree``. ``on_cpu``: the shards live in host
    memory (CPU offload) even where the ranks compute on a GPU.
    """
    if not models:
        return [0] * world.world_size
    shards = [
        {name: transfer.rank_tensors(model, rank % shard_degree, shard_degree) for name, model in models.items()}
        for rank in range(world.world_size)
    ]
    allocations = [
        {
            name: ShardAllocation(token=tokens[name], tensors=transfer.layout(tensors), on_cpu=on_cpu)
            for name, tensors in by_model.items()
        }
        for by_model in shards
    ]
    biggest = max(sum(t.nbytes for tensors in by_model.values() for t in tensors.values()) for by_model in shards)
    streams = [transfer.pieces(by_model, transfer.piece_bytes(biggest)) for by_model in shards]
    received = [0] * world.world_size
    first = True
    while True:
        batch = {rank: next(stream, None) for rank, stream in enumerate(streams)}
        sending = {rank: piece or [] for rank, piece in batch.items() if piece is not None or first}
        if not sending:
            return received
        results = {}
        for rank, piece in sending.items():
            keys = [key for key, _ in piece]
            data = [part for _, part in piece]  # each its own argument: ipyparallel sends each as a frame
            allocate = allocations[rank] if first else {}
            view = cluster.client[world.engine_ids[rank]]
            results[rank] = view.apply_async(engine.receive_shards, world.generation, allocate, keys, *data)
        for rank, result in results.items():
            received[rank] += _wait(cluster, world, rank, result)
        first = False


def _wait(cluster: Cluster, world: World, rank: int, result: ipp.AsyncResult) -> int:
    """A rank's answer to one piece; a rank that fails or dies ends the delivery with its error."""
    while not result.ready():
        result.wait(LIVENESS_SECONDS)
        if not result.ready() and rank in (dead := cluster.dead_ranks()):
            world.broken = True
            raise RankError(rank, f"engine died while receiving its shards: {dead[rank]}")
    try:
        return result.get()
    except (ipp_error.RemoteError, ipp_error.EngineError) as error:
        world.broken = True
        # the controller may report the death first, as an EngineError (raised, or remote)
        died = isinstance(error, ipp_error.EngineError) or error.ename == "EngineError"
        how = cluster.how_rank_died(rank, within=2.0 if died else 0.0)
        if died or how:
            raise RankError(rank, f"engine died while receiving its shards: {how or 'it stopped answering'}") from None
        raise RankError(rank, f"{error.ename}: {error.evalue} (while receiving its shards)") from None
