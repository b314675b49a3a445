"""%fsdp explain and nbfsdp.explain: the plan before the run, held to what the run measures."""

from __future__ import annotations

import pytest
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.shared.collectives import ring_bytes
from tests.conftest import run_ok
from tests.test_metrics import MEASURE

pytestmark = pytest.mark.timeout(240)


def _within(predicted: float, measured: float, tolerance: float = 0.05) -> bool:
    return abs(predicted - measured) <= tolerance * measured


@pytest.mark.parametrize("world_size", [2, 4])
def test_predicted_memory_matches_fsdp_mem_tracker(shell, tiny_model, world_size):
    run_ok(shell, "torch.manual_seed(0)\nwide = Net(width=96, depth=3)\n")
    wide = shell.user_ns["wide"]
    plan = nbfsdp.explain(wide, world_size=world_size, wrap_cls="Block")
    run_ok(shell, MEASURE.replace("--world-size 2", f"--world-size {world_size} --wrap-cls Block"))
    assert {u.name for u in plan.units} == set(nbfsdp.last_run().config["fsdp_units"]["wide"])
    for rank, oracle in enumerate(shell.user_ns["oracles"]):
        predicted = plan.memory[rank]
        measured = {
            "params": oracle["peak"]["Sharded Param"],
            "grads": oracle["at_step"]["Sharded Grad"],
            "optim": oracle["after_step"]["OptState"],
        }
        for name, value in measured.items():
            assert _within(predicted[name], value), f"rank {rank} {name}: predicted {predicted[name]}, tracker {value}"


def test_the_plan_shows_units_checkpointing_precision_prefetch_and_communication(shell, tiny_model, capsys):
    runs_before = len(nbfsdp.runs())
    shell.run_line_magic(
        "fsdp",
        "explain --world-size 4 --wrap-cls Block --activation-checkpointing --forward-prefetch "
        "--sharding-strategy SHARD_GRAD_OP --mixed-precision PURE model",
    )
    out = capsys.readouterr().out
    assert len(nbfsdp.runs()) == runs_before  # nothing ran
    assert (
        "FSDP plan at world size 4, 4 ranks on the CPU (gloo): SHARD_GRAD_OP, mixed precision PURE "
        "(params bfloat16, reduce bfloat16"
    ) in out
    assert "activation checkpointing: blocks.0, blocks.1, blocks.2" in out
    assert "forward order (as registered): (root) -> blocks.0 -> blocks.1 -> blocks.2" in out
    assert "blocks.0 prefetches blocks.1, blocks.1 prefetches blocks.2" in out
    assert "backward order: blocks.2 -> blocks.1 -> blocks.0 -> (root)" in out
    assert "rank 3 predicted: params" in out and "per step per rank, tensors the collectives handle: all-gather" in out

    plan = nbfsdp.explain(tiny_model, world_size=4, wrap_cls="Block", sharding_strategy="SHARD_GRAD_OP")
    blocks = [u for u in plan.units if u.cls == "Block"]
    assert [u.name for u in plan.units] == ["", "blocks.0", "blocks.1", "blocks.2"]
    assert all(u.params == sum(p.numel() for p in tiny_model.blocks[0].parameters()) for u in blocks)
    # ZeRO-2 gathers each unit once a step, ZeRO-3 twice (forward and backward) but the root once
    zero3 = nbfsdp.explain(tiny_model, world_size=4, wrap_cls="Block", mixed_precision="FULL")
    zero2 = nbfsdp.explain(
        tiny_model, world_size=4, wrap_cls="Block", mixed_precision="FULL", sharding_strategy="SHARD_GRAD_OP"
    )
    block_bytes = sum(u.full_bytes for u in blocks)
    assert zero3.communication["all_gather"] - zero2.communication["all_gather"] == block_bytes
    assert zero2.communication["reduce_scatter"] == sum(u.full_bytes for u in plan.units)
    # per-rank memory falls as 1/N
    one = nbfsdp.explain(tiny_model, world_size=1, mixed_precision="FULL").memory[0]["params"]
    assert abs(zero3.memory[0]["params"] * 4 - one) <= 0.05 * one


def test_explain_refuses_what_is_not_a_model(shell):
    shell.user_ns["not_a_model"] = 3
    with pytest.raises(UsageError, match="not_a_model: a int, not an nn.Module"):
        shell.run_line_magic("fsdp", "explain not_a_model")
    with pytest.raises(UsageError, match="invalid choice: 'ZERO'"):
        shell.run_line_magic("fsdp", "explain --sharding-strategy ZERO model")


def test_ring_bytes_are_the_ring_algorithms_shares():
    assert ring_bytes("all_gather", 4000, 4) == ring_bytes("reduce_scatter", 4000, 4) == 3000  # (N-1)/N
    assert ring_bytes("all_reduce", 4000, 4) == 6000  # 2(N-1)/N
    assert ring_bytes("all_reduce", 4000, 1) == ring_bytes("all_gather", 4000, 1) == 0


COMMUNICATION = """%%fsdp --world-size 2 --wrap-cls MLPBlock --mixed-precision FULL --no-gather {settings}
from nbfsdp.course import CommMeter, rotation_batch
with CommMeter() as comm:
    x, y = rotation_batch(rank, 0)
    torch.nn.functional.mse_loss(mlp(x.to(device)), y.to(device)).backward()
tensors, sent, calls = comm.totals(), comm.sent(), comm.calls
"""


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_bytes_on_the_wire_match_what_a_rank_measures(shell, capsys, strategy):
    """explain's tensor sizes and ring bytes against the collectives a rank runs in one step (CommMeter)."""
    run_ok(shell, "from nbfsdp.course import MLP\ntorch.manual_seed(0)\nmlp = MLP(width=64, depth=3)\n")
    plan = nbfsdp.explain(
        shell.user_ns["mlp"], world_size=2, wrap_cls="MLPBlock", mixed_precision="FULL", sharding_strategy=strategy
    )
    run_ok(shell, COMMUNICATION.format(settings=f"--sharding-strategy {strategy}"))
    tensors, sent = shell.user_ns["tensors"], shell.user_ns["sent"]
    for kind, wire in plan.wire.items():
        assert tensors[kind] == wire["tensor"] == plan.communication[kind], (kind, tensors, plan.wire)
        assert sent[kind] == wire["sent"] == wire["received"], (kind, sent, plan.wire)
    assert {group for _, _, group in shell.user_ns["calls"]} == {2}
    psi = sum(p.numel() * 4 for p in shell.user_ns["mlp"].parameters())
    total = sum(w["sent"] for w in plan.wire.values())
    # a rank sends (N-1)/N of: 2 psi for NO_SHARD (all-reduce) and SHARD_GRAD_OP, 3 psi for FULL_SHARD less the
    # root's second gather (FSDP2 keeps the root gathered into backward)
    root = plan.units[0].full_bytes
    expected = {"NO_SHARD": 2 * psi, "SHARD_GRAD_OP": 2 * psi, "FULL_SHARD": 3 * psi - root}[strategy] // 2
    assert abs(total - expected) <= 2, (total, expected)
    capsys.readouterr()
    shell.run_line_magic("fsdp", f"explain --world-size 2 --wrap-cls MLPBlock --sharding-strategy {strategy} mlp")
    assert "bytes sent (and as many received) under the ring algorithms" in capsys.readouterr().out


TWO_HOSTS = ["a", "a", "b", "b"]


def _fp32_bytes(module) -> int:
    return sum(p.numel() * 4 for p in module.parameters())


def test_full_shard_over_two_hosts_sends_every_gather_and_reduce_scatter_between_them(tiny_model):
    """One shard group of 4 ranks, 2 on each host: its ring has 2 links between hosts, each carrying 3/4 of
    the tensor a rank sends."""
    plan = nbfsdp.explain(tiny_model, world_size=4, hosts=TWO_HOSTS, wrap_cls="Block", mixed_precision="FULL")
    psi = _fp32_bytes(tiny_model)
    blocks = sum(_fp32_bytes(block) for block in tiny_model.blocks)
    gathered = (psi - blocks) + 2 * blocks  # the root once a step, every block in forward and in backward
    assert plan.wire["all_gather"]["cross_host"] == 2 * (gathered * 3 // 4)
    assert plan.wire["reduce_scatter"]["cross_host"] == 2 * (psi * 3 // 4)
    assert plan.wire["all_reduce"]["cross_host"] == 0
    assert plan.cross_host["reduce_scatter"] == {"a": psi * 3 // 4, "b": psi * 3 // 4}
    text = str(plan)
    assert "hosts: a (ranks 0-1), b (ranks 2-3)" in text
    assert "mesh (replicate 1, shard 4): shard groups across hosts (ranks 0-3)" in text
    assert f"all-gather: crosses hosts: {2 * (gathered * 3 // 4):,} bytes/step" in text
    assert f"reduce-scatter: crosses hosts: {2 * (psi * 3 // 4):,} bytes/step" in text


def test_hybrid_shard_over_two_hosts_sends_only_the_all_reduce_between_them(tiny_model):
    """Mesh (replicate 2, shard 2), a host per replica: gathers and reduce-scatters stay inside each host;
    the all-reduce of each rank's gradient shard runs in 2 groups of 2 ranks, every link between hosts."""
    plan = nbfsdp.explain(
        tiny_model,
        world_size=4,
        hosts=TWO_HOSTS,
        wrap_cls="Block",
        mixed_precision="FULL",
        sharding_strategy="HYBRID_SHARD",
        replicas=2,
    )
    shard = sum(-(-p.shape[0] // 2) * (p.numel() // p.shape[0]) * 4 for p in tiny_model.parameters())  # padded
    assert plan.wire["all_gather"]["cross_host"] == plan.wire["reduce_scatter"]["cross_host"] == 0
    assert plan.wire["all_gather"]["sent"] > 0  # they run, inside each host
    # a rank sends 2(g-1)/g = 1 x its shard; 2 links per group, 2 groups
    assert plan.wire["all_reduce"]["cross_host"] == 2 * 2 * shard
    assert plan.cross_host["all_reduce"] == {"a": 2 * shard, "b": 2 * shard}
    text = str(plan)
    assert (
        "mesh (replicate 2, shard 2): shard groups inside each host (a: ranks 0-1; b: ranks 2-3), "
        "replicate groups across hosts (ranks 0,2; ranks 1,3)"
    ) in text
    assert "all-gather: inside each host" in text and "reduce-scatter: inside each host" in text
    assert f"all-reduce: crosses hosts: {4 * shard:,} bytes/step" in text


def test_one_host_prints_the_plan_as_before(tiny_model):
    plain = nbfsdp.explain(tiny_model, world_size=4, wrap_cls="Block")
    one_host = nbfsdp.explain(tiny_model, world_size=4, hosts=["a"] * 4, wrap_cls="Block")
    assert str(one_host) == str(plain) and "hosts:" not in str(plain) and one_host.hosts == []
    with pytest.raises(UsageError, match="hosts: 2 given for world size 4"):
        nbfsdp.explain(tiny_model, world_size=4, hosts=["a", "b"])
