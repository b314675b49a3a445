"""The planner's cost model (``fitting``): NCCL's bus bandwidth inside and between nodes, communication hidden
behind compute, micro-batches' collectives, selective checkpointing, NCCL's buffers in the margin, and the
no-batch comm buffers as a lower bound. Kernel only: plans on the meta device, nothing runs on ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.planning import fitting


class Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 8, -1).permute(2, 0, 3, 1, 4)  # 8 heads
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn, self.mlp = Attention(width), nn.Sequential(nn.Linear(width, 4 * width), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self, width: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(64, width), nn.Linear(width, 64)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(scope="module")
def net() -> Net:
    with torch.device("meta"):
        return Net()


def _batch(ranks: int, tokens: int) -> torch.Tensor:
    return torch.empty(ranks, tokens, 64, device="meta")


def _plan(net: Net, world_size: int = 8, **settings):
    return nbfsdp.explain(net, world_size=world_size, device="cuda", wrap_cls="Block", min_params=10**15, **settings)


def test_a_collective_runs_at_nvlinks_bus_bandwidth_inside_a_node_and_the_nics_between_nodes(net):
    inside = _plan(net)
    seconds = fitting.collective_seconds(inside, latency=False)
    assert seconds["all_gather"] == inside.wire["all_gather"]["sent"] / fitting.NODE_BUS_BANDWIDTH
    # 16 ranks on 2 nodes of 8: a ring leaves each node once, what one rank sends, over the NICs together
    hosts = [f"n{r // 8}" for r in range(16)]
    spread = _plan(net, 16, hosts=hosts)
    out = max(spread.cross_host["all_gather"].values())
    assert out == spread.wire["all_gather"]["sent"]
    expected = max(out / fitting.NETWORK_BANDWIDTH, spread.wire["all_gather"]["sent"] / fitting.NODE_BUS_BANDWIDTH)
    assert fitting.collective_seconds(spread, latency=False)["all_gather"] == expected
    # not one NIC's 50 GB/s: the whole ring's bytes at the node's 340 GB/s
    assert (
        fitting.collective_seconds(spread, latency=False)["all_gather"] < spread.wire["all_gather"]["sent"] / 50e9 / 5
    )
    # a plan without hosts is placed 8 ranks to a node: the same seconds as naming them
    assert fitting.collective_seconds(_plan(net, 16), latency=False) == fitting.collective_seconds(
        spread, latency=False
    )
    # HSDP over 2 x 8: the replica groups' all-reduce crosses, S of them out of each node at once
    hsdp = _plan(net, 16, hosts=hosts, sharding_strategy="HYBRID_SHARD", replicas=2)
    crossing = max(hsdp.cross_host["all_reduce"].values())
    assert crossing == 8 * hsdp.wire["all_reduce"]["sent"]
    assert fitting.collective_seconds(hsdp, latency=False)["all_reduce"] == crossing / fitting.NETWORK_BANDWIDTH
    assert (
        fitting.collective_seconds(hsdp, latency=False)["all_gather"]
        == hsdp.wire["all_gather"]["sent"] / fitting.NODE_BUS_BANDWIDTH
    )


def test_communication_counts_only_where_compute_cannot_hide_it(net):
    many = _plan(net, batch=_batch(8, 65536))  # a rank's units compute far longer than they gather
    few = _plan(net, batch=_batch(8, 16))
    seconds = fitting.collective_seconds(many, latency=False)
    per_gather, per_reduction = (fitting.call_latency(many, kind) for kind in ("all_gather", "reduce_scatter"))
    gather = [
        u.gathered_bytes * seconds["all_gather"] / many.wire["all_gather"]["tensor"] + per_gather for u in many.units
    ]
    reduction = [
        seconds["reduce_scatter"] * u.params / sum(u.params for u in many.units) + per_reduction for u in many.units
    ]
    root_forward = 2 * many.units[0].params * many.tokens / fitting.FLOPS
    hidden = fitting.step_time(many)
    # all hidden but the first gather of each pass (the root's in forward, the last block's in backward), what the
    # root's short compute cannot hide of the first block's gather and reduction (in forward, the root computes
    # before it; in backward, after), and the root's own reduction at backward's end
    first_block = gather[1] - root_forward + reduction[1] - 2 * root_forward
    assert hidden.exposed == pytest.approx(gather[0] + gather[-1] + first_block + reduction[0])
    assert hidden.exposed < 0.1 * sum(fitting.collective_seconds(many).values())
    assert hidden.compute == pytest.approx(6 * sum(u.params for u in many.units) * many.tokens / fitting.FLOPS)
    # at 16 tokens a rank compute hides almost nothing: the step is the collectives, in sequence
    exposed = fitting.step_time(few)
    assert exposed.exposed > 0.9 * sum(fitting.collective_seconds(few).values())
    assert exposed.exposed > 10 * exposed.compute


def test_each_collective_pays_nccls_latency_a_ring_step_longer_between_nodes():
    """NCCL's tuner model (tuning.cc, Simple): 8.4 us to start, 3.4 us a step on NVLink, 14 us a step between
    nodes; a tree all-reduce where that is shorter. Its figure for a flat ring over 128 x 8 ranks: about 4.8 ms."""
    assert fitting.collective_latency("all_gather", 8, 1) == pytest.approx(8.4e-6 + 7 * 3.4e-6)
    assert fitting.collective_latency("reduce_scatter", 1024, 128) == pytest.approx(
        8.4e-6 + (1023 - 127) * 3.4e-6 + 127 * 14e-6
    )
    assert 4.7e-3 < fitting.collective_latency("all_gather", 1024, 128) < 4.9e-3
    assert fitting.collective_latency("all_gather", 1, 1) == 0.0
    # an all-reduce over one rank a node (HSDP's replica groups): the tree's 2 log2(n) hops, not the ring's 2n
    tree = 2 * 7 * 28e-6
    assert fitting.collective_latency("all_reduce", 128, 128) == pytest.approx(tree)
    assert fitting.collective_latency("all_reduce", 8, 1) == pytest.approx(8.4e-6 + 14 * 3.4e-6)  # the ring's


def test_a_plan_pays_the_latency_once_a_call_in_groups_of_the_nodes_they_span(net):
    plan = _plan(net)  # 8 ranks, one node: 9 units, 17 gathers (the root stays gathered for backward), 9 reductions
    assert fitting.collective_calls(plan) == {"all_gather": 17, "reduce_scatter": 9, "all_reduce": 0}
    with_latency, without = fitting.collective_seconds(plan), fitting.collective_seconds(plan, latency=False)
    assert with_latency["all_gather"] - without["all_gather"] == pytest.approx(17 * (8.4e-6 + 7 * 3.4e-6))
    assert with_latency["all_reduce"] == without["all_reduce"] == 0.0
    # HSDP over 2 x 8: gathers inside a node, all-reduces over one rank a node
    hsdp = _plan(net, 16, sharding_strategy="HYBRID_SHARD", replicas=2)
    assert fitting.group_nodes(hsdp, "all_gather") == 1 and fitting.group_nodes(hsdp, "all_reduce") == 2
    assert fitting.call_latency(hsdp, "all_reduce") == fitting.collective_latency("all_reduce", 2, 2)
    # a flat group over 64 nodes pays its hops once a call: a small unit's step is latency-bound
    wide = _plan(net, 512)
    assert fitting.call_latency(wide, "all_gather") == fitting.collective_latency("all_gather", 512, 64)
    assert fitting.call_latency(wide, "all_gather") > 70 * fitting.call_latency(plan, "all_gather")  # 2.4 ms, 32 us
    assert (
        fitting.step_time(_plan(net, 512, batch=_batch(512, 4096))).exposed
        > fitting.step_time(_plan(net, 8, batch=_batch(8, 4096))).exposed
    )


def test_the_tokens_that_hide_a_unit_are_taken_phase_by_phase_and_grow_with_n_and_as_the_unit_shrinks():
    """Backward binds: a bf16 gather and an fp32 reduce-scatter (6 bytes a parameter) against 4 FLOPs a parameter
    a token, 1.5 (N-1)/N F/B tokens before latency; forward's 2 bytes against 2 FLOPs, (N-1)/N F/B."""
    layer = 202_383_360  # a Llama-7B layer
    f_over_b = fitting.FLOPS / fitting.NODE_BUS_BANDWIDTH
    node = fitting.hiding_tokens(layer, 8)
    latency = {k: fitting.collective_latency(k, 8, 1) for k in ("all_gather", "reduce_scatter")}
    assert node["forward"] == pytest.approx(7 / 8 * f_over_b + latency["all_gather"] * fitting.FLOPS / (2 * layer))
    assert node["backward"] == pytest.approx(
        1.5 * 7 / 8 * f_over_b + sum(latency.values()) * fitting.FLOPS / (4 * layer)
    )
    assert node["backward"] > node["forward"]
    # a smaller unit needs more tokens (the latency is per call); more ranks over more nodes, many more
    assert fitting.hiding_tokens(layer // 8, 8)["backward"] > node["backward"]
    flat = fitting.hiding_tokens(layer, 1024, 128)
    assert flat["backward"] > 4096 > fitting.hiding_tokens(layer, 1024, 128, bandwidth=1e30)["backward"] - 4096
    assert fitting.hiding_tokens(layer, 8, strategy="SHARD_GRAD_OP")["backward"] < node["backward"]
    assert fitting.hiding_tokens(layer, 8, strategy="NO_SHARD")["forward"] == 0.0


def test_micro_batches_repeat_the_gathers_and_the_reductions(net):
    one = _plan(net, batch=_batch(8, 16))  # communication-bound: every collective shows
    in_one, in_four = fitting.step_time(one), fitting.step_time(one, micro_batches=4)
    assert in_four.compute == pytest.approx(in_one.compute)  # the same tokens
    # each micro-batch gathers every unit again and reduce-scatters its gradients (the sync FSDP2 does by default)
    assert in_four.exposed == pytest.approx(4 * in_one.exposed, rel=0.05)
    assert fitting.step_cost(one, one, 4) == pytest.approx(in_four.total - in_one.total)


def test_selective_checkpointing_recomputes_every_kth_block_or_attention_alone(net):
    batch = _batch(8, 4096)
    full = _plan(net, batch=batch, activation_checkpointing=True)
    every2 = _plan(net, batch=batch, activation_checkpointing=True, checkpoint_every=2)
    attention = _plan(net, batch=batch, activation_checkpointing=True, checkpoint_scope="attention")
    none = _plan(net, batch=batch)
    assert full.checkpointed == [f"blocks.{i}" for i in range(8)]
    assert every2.checkpointed == [f"blocks.{i}" for i in range(0, 8, 2)]
    assert attention.checkpointed == [f"blocks.{i}.attn" for i in range(8)]
    block, attn = net.blocks[0], net.blocks[0].attn
    recomputed = lambda plan: sum(u.recomputed for u in plan.units)  # noqa: E731
    assert recomputed(full) == 8 * sum(p.numel() for p in block.parameters())
    assert recomputed(every2) == 4 * sum(p.numel() for p in block.parameters())
    assert recomputed(attention) == 8 * sum(p.numel() for p in attn.parameters())
    # each recomputed parameter costs 2 FLOPs a token: the cost sits between none and full, in that order
    cost = [fitting.step_time(p).compute for p in (none, attention, every2, full)]
    assert cost == sorted(cost) and len(set(cost)) == 4, cost
    assert cost[3] - cost[0] == pytest.approx(2 * recomputed(full) * full.tokens / fitting.FLOPS)
    kept = [p.peak[0]["activations"] for p in (none, attention, every2, full)]
    assert kept[0] > max(kept[1:3]) and min(kept[1:3]) > kept[3], kept
    with pytest.raises(UsageError, match=r"checkpoint_scope attention: 0 \(Linear\) has no submodule"):
        nbfsdp.explain(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), world_size=2, wrap_cls="Linear",
                       activation_checkpointing=True, checkpoint_scope="attention")  # fmt: skip
    with pytest.raises(UsageError, match="checkpoint_scope must be one of block, attention"):
        _plan(net, checkpoint_scope="mlp")


def test_the_search_offers_selective_checkpointing_and_ranks_what_costs_least():
    with torch.device("meta"):
        wide = Net(width=2048, depth=8)
    batch = _batch(8, 8192)
    asked = _plan(wide, batch=batch)
    need = asked.peak[0]["total"]
    found = nbfsdp.explain(
        wide, world_size=8, device="cuda", wrap_cls="Block", min_params=10**15, batch=batch,
        device_memory=int(need * 0.9 * (1 + fitting.ALLOCATOR_FRACTION)) + fitting.CONTEXT_BYTES
        + fitting.NCCL_BYTES_PER_GROUP, suggest=True,
    )  # fmt: skip
    changes = [s.change for s in found.suggestions]
    assert "checkpointing every 2nd block" in changes, changes
    costs = {s.change: s.cost_seconds for s in found.suggestions}
    assert costs["checkpointing every 2nd block"] < costs.get("activation checkpointing", float("inf"))
    for s in found.suggestions:
        micro = s.change_settings.get("micro_batches", 1)
        assert s.cost_seconds == pytest.approx(fitting.step_time(s, micro).total - fitting.step_time(asked).total)


def test_ncclss_buffers_come_out_of_the_gpu_by_process_group(net):
    batch = _batch(8, 512)
    one_dim = _plan(net, batch=batch, gpu="H100")
    hsdp = _plan(net, batch=batch, gpu="H100", sharding_strategy="HYBRID_SHARD", replicas=2)
    h100 = fitting.gpu_memory("H100")
    assert one_dim.device_memory["nccl"] == fitting.NCCL_BYTES_PER_GROUP_NVLS  # Hopper: NVLS's buffers
    assert hsdp.device_memory["nccl"] == 3 * fitting.NCCL_BYTES_PER_GROUP_NVLS  # the world, shard and replicate
    # HSDP over 2 whole nodes: the replicate group has one rank a node, no NVLink peer, so no NVLS buffers
    across = _plan(net, 16, batch=_batch(16, 512), gpu="H100", sharding_strategy="HYBRID_SHARD", replicas=2)
    assert fitting.network_groups(across) == 1 and fitting.network_groups(hsdp) == 0
    assert across.device_memory["nccl"] == 2 * fitting.NCCL_BYTES_PER_GROUP_NVLS + fitting.NCCL_BYTES_PER_GROUP
    assert one_dim.device_memory["usable"] == dataclasses.replace(h100, nccl_groups=1).usable < h100.usable
    a100 = _plan(net, batch=batch, gpu="A100")
    assert a100.device_memory["nccl"] == fitting.NCCL_BYTES_PER_GROUP
    on_cpu = nbfsdp.explain(net, world_size=2, wrap_cls="Block", batch=_batch(2, 8), device_memory="8GiB")
    assert "nccl" in on_cpu.device_memory and on_cpu.device_memory["nccl"] == 0  # gloo: no NCCL
    assert "of NCCL's buffers" in str(one_dim)


def test_without_a_batch_the_comm_buffers_are_a_lower_bound_by_strategy(net):
    units = _plan(net).units
    root, block = units[0], units[1]
    assert _plan(net).memory[0]["comm_buffers"] == root.gathered_bytes + 2 * block.gathered_bytes
    sgo = _plan(net, sharding_strategy="SHARD_GRAD_OP").memory[0]["comm_buffers"]
    assert sgo == sum(u.gathered_bytes for u in units) + units[-1].gathered_bytes
    assert _plan(net, sharding_strategy="NO_SHARD").memory[0]["comm_buffers"] == 0
    assert "comm buffers at peak at least" in str(_plan(net))
