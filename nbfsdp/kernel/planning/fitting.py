"""Does it fit? A device's memory, the margin kept for the allocator, and the cheapest settings that fit.

``%fsdp explain MODEL --batch B --gpu H100`` (``nbfsdp.explain(..., gpu="H100")``) holds each rank's
traced peak (``nbfsdp.kernel.planning.peak``) against the GPU's memory less a margin: ``Plan.fits``. With
``--suggest``, plans of other settings, each traced the same way, that fit, cheapest first by the cost
model below. Runs in the kernel; nothing runs on the ranks.

The margin is what a CUDA process needs beyond the tensors ``max_memory_allocated`` counts: its CUDA
context and cuBLAS's workspace (``CONTEXT_BYTES``), and what the caching allocator reserves above what
it has allocated, rounding and fragmentation (``ALLOCATOR_FRACTION`` of the peak). Their values and where
they come from are in ``docs/guide/explain.md``.

The margin also holds NCCL's own buffers, which it allocates outside the caching allocator: one
communicator's worth (``NCCL_BYTES_PER_GROUP``, more with NVLS on Hopper where the group has NVLink peers) for
each process group a rank runs collectives on (``nccl_groups``: 1 for a mesh of one dimension, 3 for HSDP's two;
``network_groups``: those with one rank a node, which have no NVLS).

The cost model (``step_time``), per step and rank on GPUs at stated rates: compute at ``FLOPS`` (2 FLOPs per
parameter and token forward, 4 backward, 2 more for each recomputed parameter); collectives at NCCL's bus
bandwidth (``collective_seconds``: ``NODE_BUS_BANDWIDTH`` inside a node, the node's NICs together,
``NETWORK_BANDWIDTH``, for what leaves it) plus NCCL's own latency for each call (``collective_latency``: a
fixed start and a hop a ring step, longer where the step crosses nodes), of which only what compute cannot
hide counts: each unit's gather runs during the previous unit's compute, its reductions during the next
unit's backward, and the first gather and the last reduction of a pass wait whole. ``hiding_tokens`` is the
same arithmetic for one unit, phase by phase: the tokens a rank needs for compute to hide it. Micro-batches
repeat the passes, each with its gathers and its gradient reductions; CPU offload copies each rank's fp32
shard up before every gather and its gradient down once over ``PCIE``, and steps AdamW on the CPU (16 bytes a
parameter at ``CPU_BANDWIDTH``). A suggestion's cost
is its step's time less the asked-for step's. More ranks cost GPUs, not time: they come last. Not counted:
attention's score FLOPs (they grow with the sequence; recomputing attention costs more than its parameters
say), kernel launch latency, and contention between the gathers' and the reductions' streams.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbfsdp.kernel.planning.placement import cross_host, replicate_groups, shard_groups
from nbfsdp.shared.config import ConfigError, size_bytes

if TYPE_CHECKING:
    from nbfsdp.kernel.planning.plans import Plan

#: Memory as ``torch.cuda.get_device_properties(0).total_memory`` / nvidia-smi report it (MiB), by family and
#: size; the first size listed is a family's default when the name gives none.
GPU_MEMORY_MIB: dict[str, dict[str, int]] = {
    "h200": {"141gb": 143771},
    "h100": {"80gb": 81559, "94gb": 95830, "96gb": 97871},
    "gh200": {"96gb": 97871, "144gb": 146944},
    "b200": {"180gb": 183359},
    "a100": {"80gb": 81920, "40gb": 40960},
    "l40s": {"48gb": 46068},
    "l40": {"48gb": 46068},
    "a10g": {"24gb": 23028},
    "a10": {"24gb": 23028},
    "l4": {"24gb": 23034},
    "t4": {"16gb": 15360},
    "v100": {"32gb": 32768, "16gb": 16384},
    "rtx4090": {"24gb": 24564},
    "rtx3090": {"24gb": 24576},
}
#: Compute capability by family: below 8.0 (T4, V100) a GPU has no bf16, and nbfsdp defaults to fp16 there.
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "h200": (9, 0), "h100": (9, 0), "gh200": (9, 0), "b200": (10, 0), "a100": (8, 0), "l40s": (8, 9), "l40": (8, 9),
    "a10g": (8, 6), "a10": (8, 6), "l4": (8, 9), "t4": (7, 5), "v100": (7, 0), "rtx4090": (8, 9), "rtx3090": (8, 6),
}  # fmt: skip
#: The CUDA context and cuBLAS's workspaces: what a process holds on the GPU before its first tensor.
CONTEXT_BYTES = 768 * 2**20
#: What the caching allocator reserves above its allocated peak (rounding, segments, fragmentation).
ALLOCATOR_FRACTION = 0.08
#: What one NCCL communicator holds on a GPU, outside the caching allocator (``cudaMalloc``'d by NCCL: channels x
#: peers x protocols' buffers): 688 MB measured for a group of more than 2 A100s on NVLink (NVIDIA/nccl#964)...
NCCL_BYTES_PER_GROUP = 688 * 10**6
#: ... and about 1.6 GB for one on Hopper, where NVLink SHARP (NVLS) adds its multicast buffers (NVIDIA/nccl#864).
NCCL_BYTES_PER_GROUP_NVLS = 1600 * 10**6
#: The cost model's rates: bf16 FLOP/s a GPU achieves, host-device bytes/s, host memory bytes/s for a CPU
#: optimizer step.
FLOPS, PCIE, CPU_BANDWIDTH = 400e12, 25e9, 20e9
#: NCCL's bus bandwidth (nccl-tests' ``busbw``: the bytes a rank sends in a ring collective, per second) of a
#: group inside one node: eight H100s on NVLink 4 through NVSwitch measure about 360 GB/s for all-gather and
#: reduce-scatter. A collective is as fast as its ring's slowest link, not one NIC's 50 GB/s.
NODE_BUS_BANDWIDTH = 360e9
#: What a node's network cards carry out of it together, per second: eight 400 Gb/s NICs (one a GPU) are 400 GB/s
#: at line rate, and 340 GB/s is 85% of it: an assumption, not a cited all-gather measurement (vendors' cluster
#: guides quote 400-450 GB/s of all-reduce bus bandwidth for H100 with NDR, which NVLS and tree algorithms reach
#: above the NICs' rate, so they do not give the all-gather's). A ring over the nodes
#: leaves each by as many links as it has channels, so a node's bytes out (``Plan.cross_host``) over this rate
#: is the time the slow links take; HSDP's S replica groups share it, each about a NIC's worth.
NETWORK_BANDWIDTH = 340e9
#: GPUs a node holds, where a plan names no hosts: ranks fill nodes in order, as torchrun and Slurm place them.
GPUS_PER_NODE = 8
#: NCCL's latency model, as its tuner weighs algorithms (NVIDIA/nccl ``src/graph/tuning.cc``,
#: ``ncclTopoTuneModel``; the Simple protocol, which carries FSDP's megabyte collectives): a ring collective
#: starts in ``baseLat`` (8.4 us), then each of its steps costs a hop, ``hwLat``: 3.4 us over NVLink, 14 us
#: where the step crosses the network. An all-gather or reduce-scatter over N ranks on n nodes takes N - 1 steps,
#: n - 1 of them between nodes; an all-reduce 2(N - 1), 2n of them between nodes.
RING_START_SECONDS = 8.4e-6
NVLINK_HOP_SECONDS = 3.4e-6
NETWORK_HOP_SECONDS = 14e-6
#: A tree all-reduce (``hwLat`` Tree, Simple: 28 us a hop on NVLink and network alike, no start) climbs
#: 2 (N/n - 1 + log2 n) hops: NCCL picks it over the ring for an all-reduce over many nodes.
TREE_HOP_SECONDS = 28e-6


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A device's memory, and what of it a training step may use."""

    name: str
    total: int
    capability: tuple[int, int] | None = None
    """A GPU named by family: its compute capability, which decides the default low precision."""
    step_share: float | None = None
    """Where given, the share of ``total`` a step may use (a rank's ``--memory-limit`` on CPU ranks, which has
    no CUDA context and no allocator, less a margin for the planner's error); else what a GPU leaves."""
    nccl_groups: int = 0
    """The NCCL communicators a rank of the plan opens: each holds buffers outside the caching allocator."""
    network_groups: int = 0
    """Of those, the groups with one rank a node (HSDP's replicate group over whole nodes): no NVLink peer, so
    no NVLS buffers even on Hopper."""

    @property
    def nccl_bytes(self) -> int:
        """What ``nccl_groups`` communicators hold on the GPU (``NCCL_BYTES_PER_GROUP``; NVLS's on Hopper on,
        for the groups with NVLink peers)."""
        if self.step_share is not None or not self.nccl_groups:
            return 0
        nvls = self.capability is not None and self.capability >= (9, 0)
        linked = self.nccl_groups - self.network_groups
        return linked * (NCCL_BYTES_PER_GROUP_NVLS if nvls else NCCL_BYTES_PER_GROUP) + (
            self.network_groups * NCCL_BYTES_PER_GROUP
        )

    @property
    def usable(self) -> int:
        """``total`` less the CUDA context and NCCL's buffers, and the allocator's share of what is left."""
        if self.step_share is not None:
            return int(self.total * self.step_share)
        return max(0, int((self.total - CONTEXT_BYTES - self.nccl_bytes) / (1 + ALLOCATOR_FRACTION)))

    def __str__(self) -> str:
        return f"{self.name} ({self.total / 2**30:.1f} GiB, {self.usable / 2**30:.1f} GiB for the step)"


def _words(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def gpu_memory(name: str) -> DeviceMemory:
    """A GPU by name, loosely: ``H100``, ``h100-80gb``, ``NVIDIA H100 80GB HBM3`` (what
    ``torch.cuda.get_device_name`` prints). A name no entry matches is a ConfigError listing them."""
    words = _words(name)
    for family in sorted(GPU_MEMORY_MIB, key=len, reverse=True):  # l40s before l40 and l4
        if family in words:
            sizes = GPU_MEMORY_MIB[family]
            size = next((s for s in sizes if s in words), next(iter(sizes)))
            return DeviceMemory(f"{family.upper()} {size.upper()}", sizes[size] * 2**20, GPU_CAPABILITY[family])
    known = ", ".join(f"{f.upper()} {s.upper()}" for f, sizes in GPU_MEMORY_MIB.items() for s in sizes)
    raise ConfigError(f"gpu {name!r}: not a GPU nbfsdp knows; known: {known} (or give --device-memory 80GiB)")


def memory_size(value: str | int | float) -> DeviceMemory:
    """``80GiB``, ``80 GB``, ``81559MiB`` or a number of bytes."""
    total = size_bytes(value, "device memory", "80GiB, 80GB or 81559MiB")
    if isinstance(value, (int, float)):
        return DeviceMemory(f"{value / 2**30:.1f} GiB", total)
    return DeviceMemory(str(value).strip(), total)


def device_memory(gpu: str | None, size: str | int | float | None, limit: int | None = None) -> DeviceMemory | None:
    """The memory to plan against: ``size`` (``--device-memory``) or the named ``gpu``, else a rank's
    ``--memory-limit`` (all of it: nbfsdp's accounting counts what the planner counts); None for none."""
    if gpu is not None and size is not None:
        raise ConfigError("give --gpu NAME or --device-memory SIZE, not both")
    if size is not None:
        return memory_size(size)
    if gpu is None and limit is not None:
        return DeviceMemory(f"--memory-limit {limit / 2**20:.1f} MiB", limit, step_share=1.0)
    return gpu_memory(gpu) if gpu is not None else None


def fits(plan: Plan, memory: DeviceMemory | None) -> bool | None:
    """Every rank's traced peak within the memory's usable part; None without a device or a peak."""
    if memory is None or not plan.peak:
        return None
    return max(rank["total"] for rank in plan.peak) <= memory.usable


# -- what would make it fit


@dataclass(frozen=True, slots=True)
class Change:
    """One setting changed against the plan asked for, and what it costs."""

    settings: dict[str, Any]
    """fsdp_config keys to change (and ``world_size``, ``micro_batches``)."""
    words: str


def candidates(config: dict[str, Any], world_size: int) -> list[Change]:
    """The changes the search tries alone, likeliest to fit first (a search with a deadline tries those):
    activation checkpointing (of every block, every 2nd, attention only), PURE, 2 and 4 micro-batches, 2x and 4x
    the ranks, HYBRID_SHARD, CPU offload (where the ranks have a GPU: on CPU ranks it moves nothing out of the
    rank's memory), then the other of FULL_SHARD and SHARD_GRAD_OP."""
    single: list[Change] = []
    if not config["activation_checkpointing"]:
        single.append(Change({"activation_checkpointing": True}, "activation checkpointing"))
        single.append(
            Change({"activation_checkpointing": True, "checkpoint_every": 2}, "checkpointing every 2nd block")
        )
        single.append(
            Change({"activation_checkpointing": True, "checkpoint_scope": "attention"}, "checkpointing attention only")
        )
    if config["mixed_precision"] != "PURE":
        single.append(Change({"mixed_precision": "PURE"}, "PURE mixed precision"))
    for micro in (2, 4):
        single.append(Change({"micro_batches": micro}, f"{micro} micro-batches with accumulation"))
    for factor in (2, 4):
        single.append(Change({"world_size": world_size * factor}, f"{world_size * factor} ranks"))
    for replicas in (2, 4):
        if world_size % replicas == 0 and world_size // replicas > 1 and config["sharding_strategy"] != "HYBRID_SHARD":
            single.append(
                Change(
                    {"sharding_strategy": "HYBRID_SHARD", "replicas": replicas}, f"HYBRID_SHARD, {replicas} replicas"
                )
            )
    if not config["cpu_offload"] and config.get("device") != "cpu":
        single.append(Change({"cpu_offload": True}, "CPU offload"))
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        if config["sharding_strategy"] != strategy:
            single.append(Change({"sharding_strategy": strategy}, strategy))
    return single


def pairs(single: list[Change], fitting_alone: set[str]) -> list[Change]:
    """Two changes together, where neither fits alone (one that does is cheaper alone: costs add) and they
    touch different settings; more ranks are not paired (they cost GPUs, not time)."""
    return [
        Change({**a.settings, **b.settings}, f"{a.words} and {b.words}")
        for i, a in enumerate(single)
        for b in single[i + 1 :]
        if a.words not in fitting_alone
        and b.words not in fitting_alone
        and not set(a.settings) & set(b.settings)
        and "world_size" not in {**a.settings, **b.settings}
    ]


def node_hosts(world_size: int) -> list[str]:
    """Each rank's node where none are named: ``GPUS_PER_NODE`` consecutive ranks to a node."""
    return [f"node{rank // GPUS_PER_NODE}" for rank in range(world_size)]


def collective_latency(kind: str, ranks: int, nodes: int) -> float:
    """NCCL's latency for one collective of ``kind`` over ``ranks`` spread on ``nodes``: a ring's start and hops
    (``RING_START_SECONDS``...); an all-reduce the lower of the ring's and the tree's, as NCCL's tuner would pick
    for a latency-bound size. Nothing for a group of one."""
    if ranks <= 1:
        return 0.0
    if kind == "all_reduce":
        steps, between = 2 * (ranks - 1), (2 * nodes if nodes > 1 else 0)
    else:
        steps, between = ranks - 1, nodes - 1
    ring = RING_START_SECONDS + (steps - between) * NVLINK_HOP_SECONDS + between * NETWORK_HOP_SECONDS
    if kind != "all_reduce":
        return ring
    return min(ring, 2 * (ranks / nodes - 1 + math.log2(nodes)) * TREE_HOP_SECONDS)


def _hosts(plan: Plan) -> list[str]:
    return plan.hosts or node_hosts(plan.world_size)


def group_nodes(plan: Plan, kind: str) -> int:
    """The nodes one group of ``kind``'s collective spans (rank 0's: the mesh's row for gathers and reduce-scatters,
    its column for all-reduces)."""
    replicas, shards = plan.mesh
    groups = replicate_groups(replicas, shards) if kind == "all_reduce" else shard_groups(replicas, shards)
    hosts = _hosts(plan)
    return len({hosts[rank] for rank in groups[0]})


def call_latency(plan: Plan, kind: str) -> float:
    """NCCL's latency for one of ``plan``'s collectives of ``kind`` (``collective_latency`` over its group)."""
    return collective_latency(kind, plan.wire[kind]["group"], group_nodes(plan, kind))


def collective_calls(plan: Plan) -> dict[str, int]:
    """The collectives of each kind a rank issues a step: a gather per unit in forward and per re-gathered unit in
    backward (FULL_SHARD: all but the root), a reduce-scatter (and under HSDP an all-reduce) per unit that trains."""
    trained = sum(1 for u in plan.units if u.params > u.frozen)
    regathered = plan.config["sharding_strategy"] in ("FULL_SHARD", "HYBRID_SHARD")
    holding = [index for index, u in enumerate(plan.units) if u.params]  # a unit with no parameters gathers nothing
    gathers = len(holding) + (sum(1 for index in holding if index) if regathered else 0)
    counts = {"all_gather": gathers, "reduce_scatter": trained, "all_reduce": trained}
    return {kind: counts[kind] if plan.wire[kind]["tensor"] else 0 for kind in plan.wire}


def collective_seconds(plan: Plan, *, latency: bool = True) -> dict[str, float]:
    """Seconds each collective of a step takes: at NCCL's bus bandwidth, the bytes a rank sends over
    ``NODE_BUS_BANDWIDTH`` inside a node, or, where its groups cross nodes, the bytes the busiest node sends
    out over ``NETWORK_BANDWIDTH``, whichever is longer; and (``latency``) NCCL's latency for each call
    (``collective_calls``, ``call_latency``). A plan without hosts is placed ``GPUS_PER_NODE`` ranks to a node."""
    out = plan.cross_host or cross_host(plan.wire, plan.mesh, _hosts(plan))
    calls = collective_calls(plan)
    return {
        kind: max(w["sent"] / NODE_BUS_BANDWIDTH, max(out.get(kind, {}).values(), default=0) / NETWORK_BANDWIDTH)
        + (calls[kind] * call_latency(plan, kind) if latency else 0.0)
        for kind, w in plan.wire.items()
    }


def hiding_tokens(
    params: int, ranks: int, nodes: int = 1, *, strategy: str = "FULL_SHARD", bandwidth: float | None = None
) -> dict[str, float]:
    """Tokens a rank must compute, phase by phase, for a unit of ``params`` parameters to hide the collectives
    beside it under ``strategy`` at DEFAULT precision (bf16 gathers, fp32 reductions), over ``ranks`` on ``nodes``
    at ``bandwidth`` (default: NVLink's inside one node, the NICs' across): forward's 2 FLOPs a parameter a token
    against the next unit's gather; backward's 4 against the next gather (FULL_SHARD) and this unit's
    reduction. Each is (N-1)/N bytes over the bandwidth plus NCCL's latency, so the tokens grow as the unit
    shrinks and the latency grows with N."""
    rate = bandwidth or (NODE_BUS_BANDWIDTH if nodes == 1 else NETWORK_BANDWIDTH)
    share = (ranks - 1) / ranks

    def seconds(kind: str, bytes_per_param: int) -> float:
        return bytes_per_param * params * (2 if kind == "all_reduce" else 1) * share / rate + collective_latency(
            kind, ranks, nodes
        )

    if strategy == "NO_SHARD":
        forward, backward = 0.0, seconds("all_reduce", 4)
    else:
        gather = seconds("all_gather", 2)
        forward = gather
        backward = (gather if strategy == "FULL_SHARD" else 0.0) + seconds("reduce_scatter", 4)
    return {"forward": forward * FLOPS / (2 * params), "backward": backward * FLOPS / (4 * params)}


def nccl_groups(plan: Plan) -> int:
    """The communicators a rank opens: the world's (every mesh of one dimension runs on it, and nbfsdp's own
    collectives do), and a 2-D mesh's shard and replicate groups besides."""
    replicas, shards = plan.mesh
    return 1 if replicas == 1 or shards == 1 else 3


def network_groups(plan: Plan) -> int:
    """Of ``nccl_groups``, those whose ranks each sit on a node of their own: a 2-D mesh's replicate group once
    its shard groups fill whole nodes. NVLS needs NVLink peers, so they hold no NVLS buffers."""
    if nccl_groups(plan) == 1:
        return 0
    return 1 if group_nodes(plan, "all_reduce") == plan.mesh[0] else 0  # as many nodes as replicas


@dataclass(frozen=True, slots=True)
class StepTime:
    """A training step of one rank on GPUs, by the cost model, in seconds."""

    compute: float
    """Forward and backward at ``FLOPS``: 2 FLOPs per parameter and token forward, 4 backward for a trained
    parameter (2 for a frozen one: its input's gradient alone), and 2 again for each recomputed parameter."""
    exposed: float
    """The communication compute does not hide: each unit's all-gather runs during the previous unit's compute
    (FSDP2 prefetches it), its reduce-scatter and all-reduce during the next unit's backward; what is longer than
    that compute waits, and the first gather of a pass and the last reduction wait whole."""
    offload: float
    """CPU offload's copies over PCIe and the optimizer's step on the CPU."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed + self.offload


def step_time(plan: Plan, micro_batches: int = 1) -> StepTime:
    """The step of ``plan`` (``plan.tokens`` a rank) in ``micro_batches`` micro-batches, each gathering every unit
    again and reducing its gradients (the gradient sync on every micro-batch, FSDP2's default)."""
    tokens = plan.tokens / micro_batches
    seconds = collective_seconds(plan, latency=False)
    rate = {kind: seconds[kind] / w["tensor"] if w["tensor"] else 0.0 for kind, w in plan.wire.items()}
    trained = [u.params - u.frozen for u in plan.units]
    reductions = seconds["reduce_scatter"] + seconds["all_reduce"]
    each_reduction = sum(
        call_latency(plan, kind) for kind in ("reduce_scatter", "all_reduce") if plan.wire[kind]["tensor"]
    )
    reduce = [reductions * t / max(1, sum(trained)) + (each_reduction if t else 0.0) for t in trained]
    each_gather = call_latency(plan, "all_gather") if plan.wire["all_gather"]["tensor"] else 0.0
    gather = [u.gathered_bytes * rate["all_gather"] + (each_gather if u.params else 0.0) for u in plan.units]
    regathered = plan.config["sharding_strategy"] in ("FULL_SHARD", "HYBRID_SHARD")  # the root stays gathered
    forward = [2 * u.params * tokens / FLOPS for u in plan.units]
    backward = [
        (2 * u.params + 2 * t + 2 * u.recomputed) * tokens / FLOPS for u, t in zip(plan.units, trained, strict=True)
    ]
    exposed = gather[0] + sum(max(0.0, g - c) for g, c in zip(gather[1:], forward[:-1], strict=True))
    order = list(range(len(plan.units) - 1, 0, -1)) + [0]  # backward: the last unit first, the root last
    back_gather = [gather[i] if regathered and i else 0.0 for i in order]
    exposed += back_gather[0] + reduce[order[-1]]
    for slot, unit in enumerate(order):
        during = (back_gather[slot + 1] if slot + 1 < len(order) else 0.0) + (reduce[order[slot - 1]] if slot else 0.0)
        exposed += max(0.0, during - backward[unit])
    offload = 0.0
    if plan.config["cpu_offload"]:
        shard = plan.memory[0]["params"]
        gathered = sum(u.gathered_bytes for u in plan.units)  # the model once, as the all-gathers carry it
        gathers_per_step = plan.wire["all_gather"]["tensor"] / max(1, gathered)  # FULL_SHARD: forward, backward
        copies = (shard * gathers_per_step * micro_batches + plan.memory[0]["grads"]) / PCIE
        offload = copies + 16 * sum(trained) / plan.mesh[1] / CPU_BANDWIDTH
    return StepTime(micro_batches * (sum(forward) + sum(backward)), micro_batches * exposed, offload)


def step_cost(plan: Plan, asked: Plan, micro_batches: int) -> float:
    """Seconds a step of ``plan`` in ``micro_batches`` adds against ``asked`` in one (negative: saves)."""
    return step_time(plan, micro_batches).total - step_time(asked).total


#: At most this many suggestions are kept, the cheapest.
MAX_SUGGESTIONS = 8


class Untried(Exception):
    """``replan`` could not try a change within the search's budget (``suggest`` counts it untried)."""


def suggest(asked: Plan, replan: Any, on_progress: Callable[[int, int], None] | None = None) -> tuple[list[Plan], int]:
    """Plans that fit, of the changes ``candidates`` lists and their ``pairs``, cheapest first (more ranks
    last), and how many changes were left untried; ``replan(change)`` makes the plan of one change (None where
    the change cannot apply; ``Untried`` where its budget is spent: an out-of-memory report's search makes at most
    a few recordings). ``on_progress(tried, known)`` after each change: how many were tried, of how many are known
    to be tried (the pairs are known once every single change has been)."""
    found: list[Plan] = []
    single = candidates(asked.config, asked.world_size)
    untried = tried = 0
    for change in single:
        untried += not _try(asked, replan, change, found)
        tried += 1
        if on_progress is not None:
            on_progress(tried, len(single))
    fitting_alone = {p.change for p in found}
    both = pairs(single, fitting_alone)
    for pair in both:
        untried += not _try(asked, replan, pair, found)
        tried += 1
        if on_progress is not None:
            on_progress(tried, len(single) + len(both))
    return sorted(found, key=lambda p: (p.gpu_factor, p.cost_seconds))[:MAX_SUGGESTIONS], untried


def _try(asked: Plan, replan: Any, change: Change, found: list[Plan]) -> bool:
    """Plan ``change``, kept in ``found`` where it fits; False where the budget left it untried."""
    try:
        planned = replan(change)
    except Untried:
        return False
    except Exception:  # a model the trace cannot run so (a cache a recompute appends to): that change untold
        return True
    if planned is None or not planned.fits:
        return True
    cost = step_cost(planned, asked, change.settings.get("micro_batches", 1))
    factor = planned.world_size / asked.world_size
    found.append(
        dataclasses.replace(
            planned, change=change.words, change_settings=change.settings, cost_seconds=cost, gpu_factor=factor
        )
    )
    return True
