"""This engine's world, as the cell runner set it up: its rank, device, namespace and sharded models. Read by
the cell runner (``engine``) and by checkpoints (``checkpointing``), which each see it through here. Runs on
the ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from nbfsdp.engines.sharding import ShardedModel
from nbfsdp.shared.checkpoints import CheckpointError

if TYPE_CHECKING:
    from nbfsdp.engines.scaling import LossScaler


@dataclass
class World:
    rank: int
    world_size: int
    device: torch.device
    generation: int
    timeout: float = 1800.0
    """Seconds a collective may wait (``--timeout``): the groups' own, lifted while a cell may stop at a prompt."""
    namespace: dict[str, Any] = field(default_factory=dict)
    models: dict[str, tuple[int, ShardedModel]] = field(default_factory=dict)  # name -> (token, model)
    meshes: dict[tuple[int, int], DeviceMesh] = field(default_factory=dict)  # a 2-D mesh makes process groups
    incoming: dict[str, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)  # delivered shards
    in_notebook: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    """Each model's shards as the notebook last got them (``engine._writes``): sent, or gathered back. A model
    whose shards are written since (a step, a load; a cell under --no-gather) is gathered by the next cell
    that gathers; one that is not, is not: a read-only cell costs no gather."""
    script_store: Any = None
    """Rank 0 of nbfsdp's own cluster: the store at ``MASTER_ADDR:MASTER_PORT``, kept as long as the world."""
    loss_scaler: LossScaler | None = None
    """The dynamic loss scale of the world's fp16 cells (``nbfsdp.engines.scaling``), kept from cell to cell."""
    clock_offset_ns: int = 0
    """This rank's clock less rank 0's, measured at the world's set-up where its ranks are on several hosts (0
    on one host, whose ranks share a clock): a captured step's times are on rank 0's clock
    (``nbfsdp.engines.timeline``)."""


current: World | None = None
"""The world this engine is in: None before the first cell's set-up, and after a failed cell tore it down."""


def of_generation(generation: int) -> World:
    """The current world, where it is the one the kernel means (``generation``); else a ``CheckpointError``."""
    if current is None or current.generation != generation:
        raise CheckpointError("world not set up")
    return current
