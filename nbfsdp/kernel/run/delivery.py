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

import torch.nn as nn

from nbfsdp.engines import engine
from nbfsdp.kernel.cluster.rank_calls import RankDied, RankError, RankFailed, gather, submit
from nbfsdp.kernel.cluster.world import Cluster, RunningWorld
from nbfsdp.kernel.run import residence
from nbfsdp.kernel.run.held import EngineHoldings
from nbfsdp.kernel.run.inputs import on_meta
from nbfsdp.kernel.run.spec import CellModel, Delivery, PreparedCell
from nbfsdp.shared import transfer
from nbfsdp.shared.protocol import Arrival, ModelRoute, ShardAllocation


def deliver(
    cluster: Cluster,
    world: RunningWorld,
    models: dict[str, nn.Module],
    tokens: dict[str, int],
    shard_degree: int,
    *,
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
        arguments = {
            # each part its own argument: ipyparallel sends each as a frame, without a copy
            rank: (
                world.generation,
                allocations[rank] if first else {},
                [key for key, _ in piece],
                *(p for _, p in piece),
            )
            for rank, piece in sending.items()
        }
        engine_ids = {rank: world.engine_ids[rank] for rank in sending}
        try:
            results = submit(cluster.client, engine_ids, engine.receive_shards, arguments)
            for rank, count in gather(results, cluster.dead_ranks).items():
                received[rank] += count
        except RankDied as died:
            world.broken = True
            raise RankError(died.rank, f"engine died while receiving its shards: {died.how}") from None
        except RankFailed as failed:
            world.broken = True
            raise RankError(failed.rank, f"{failed.ename}: {failed.evalue} (while receiving its shards)") from None
        first = False


def send_models(cluster: Cluster, world: RunningWorld, prepared: PreparedCell, held: EngineHoldings) -> Delivery:
    """Deliver the shards of the cell's models the ranks do not hold as they are; each model's route."""
    models = prepared.models
    sending = [name for name, model in models.items() if not held.holds(name, model.fingerprint)]
    if sending:
        held.models_sent(prepared.kept)
    tokens = held.tokens_for(list(models), sending)
    routes = {name: _route(model, tokens[name], sent=name in sending) for name, model in models.items()}
    delivering = {name: models[name].module for name, route in routes.items() if route.arrives is Arrival.DELIVERED}
    _, shard_degree = prepared.config.mesh_shape(world.world_size)
    received = deliver(cluster, world, delivering, tokens, shard_degree, on_cpu=prepared.config.cpu_offload)
    skeletons = {name: models[name].skeleton for name in sending}
    sent_bytes = [n + len(prepared.values) + sum(map(len, skeletons.values())) for n in received]
    return Delivery(routes=routes, sending=skeletons, sent_bytes=sent_bytes)


def _route(model: CellModel, token: int, *, sent: bool) -> ModelRoute:
    """How ``model`` reaches the ranks: held there, its shards delivered, or, built on the meta device, initialized
    there or read there from the checkpoint it lives on the ranks from."""
    arrives, source = Arrival.HELD, None
    if sent and not on_meta(model.module):
        arrives = Arrival.DELIVERED
    elif sent:
        record = residence.of(model.module)
        source = record.source if record is not None else None
        arrives = Arrival.INITIALIZED if source is None else Arrival.READ
    return ModelRoute(token=token, arrives=arrives, returns=model.returns, on_ranks=model.on_ranks, source=source)
