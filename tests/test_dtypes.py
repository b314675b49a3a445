"""Parameters of several dtypes (issue 44, point 1): a bare ``%%fsdp`` computes what one process computes, a tensor
stored in bf16 is never cast up, ``STORED`` (FSDP2's own defaults) keeps every tensor as stored, a unit whose
trainable parameters mix dtypes is split into one unit per dtype, and ``explain`` counts the bytes each dtype
moves."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.shared.config import ConfigError, FSDPConfig
from nbfsdp.shared.units import wrap_units
from tests.conftest import forget_after_each_test, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(240)]

STEPS = 5
MODEL = """
import torch, torch.nn as nn, nbfsdp

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)  # fp32, beside a bf16 Linear
        self.linear = nn.Linear(16, 16).to(torch.bfloat16)

    def forward(self, x):
        return x + self.linear(self.norm(x).to(torch.bfloat16)).float()  # written for a bf16 Linear

class Mixed(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 16).to(torch.bfloat16)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.embed(x.to(torch.bfloat16)).float()
        for block in self.blocks:
            x = block(x)
        return self.head(x)

torch.manual_seed(0)
mixed = Mixed()
data = torch.randn(5, 8, 4, generator=torch.Generator().manual_seed(1))
target = torch.randn(5, 8, 1, generator=torch.Generator().manual_seed(2))
"""
TRAIN = """%%fsdp --world-size 2 {flags}
opt = torch.optim.SGD(mixed.parameters(), lr=0.05)
for step in range(5):
    loss = torch.nn.functional.mse_loss(mixed(data[step][rank::world_size]), target[step][rank::world_size])
    loss.backward()
    opt.step()
    opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
"""


_forget = forget_after_each_test("Block", "Mixed", "mixed", "data", "target", "opt", "loss", "step", "as_stored")


def _one_process(model: nn.Module, data: torch.Tensor, target: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(data[step]), target[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "flags", ["", "--mixed-precision STORED", "--config as_stored"], ids=["bare", "STORED", "param_dtype stored"]
)
def test_fp32_norms_beside_bf16_weights_train_as_one_process(shell, flags):
    run_ok(shell, MODEL)
    shell.user_ns["as_stored"] = {"mixed_precision": {"param_dtype": "stored", "reduce_dtype": "fp32"}}
    mixed = shell.user_ns["mixed"]
    reference = copy.deepcopy(mixed)
    run_ok(shell, TRAIN.format(flags=flags))
    run = nbfsdp.last_run()
    measured = [(a + b) / 2 for a, b in zip(run.metric("loss", 0), run.metric("loss", 1), strict=True)]
    expected = _one_process(reference, shell.user_ns["data"], shell.user_ns["target"])
    torch.testing.assert_close(measured, expected, rtol=1.6e-2, atol=1e-5)  # bf16 rounding
    for (name, trained), (_, wanted) in zip(mixed.named_parameters(), reference.named_parameters(), strict=True):
        assert trained.dtype == wanted.dtype, name  # each kept as stored
        torch.testing.assert_close(trained, wanted, rtol=1.6e-2, atol=2e-3, msg=name)
    assert set(run.config["fsdp_units"]["mixed"]) >= {"blocks.0.norm", "blocks.1.norm", "head"}  # split by dtype


def test_explain_says_which_units_were_split_and_counts_the_bytes_as_stored(shell):
    run_ok(shell, MODEL)
    mixed = shell.user_ns["mixed"]
    plan = nbfsdp.explain(mixed, world_size=2)
    text = str(plan)
    assert "mixed precision FULL (params as stored (bfloat16 and float32), reduce float32" in text
    assert (
        "blocks.0 is split by dtype: its trainable parameters are stored in bfloat16 and float32, and FSDP2 needs "
        "one dtype a unit; blocks.0.norm (float32) is a unit of its own"
    ) in text
    assert "the root is split by dtype" in text and "head (float32) is a unit of its own" in text
    units = {u.name: u for u in plan.units}
    for name, unit in units.items():  # each parameter gathered in the dtype it is stored in
        module = mixed.get_submodule(name)
        inside = {id(p) for other in units if other != name and other.startswith(name) for p in
                  mixed.get_submodule(other).parameters()}  # fmt: skip
        own = [p for p in module.parameters() if id(p) not in inside]
        assert unit.gathered_bytes == sum(p.numel() * p.element_size() for p in own), name
    stored = sum(p.numel() * p.element_size() for p in mixed.parameters())
    root = units[""].gathered_bytes
    assert plan.communication["all_gather"] == 2 * stored - root  # FULL_SHARD: twice a step, the root once
    pure = nbfsdp.explain(mixed, world_size=2, mixed_precision="PURE")  # bf16 everywhere: the fp32 ones halve
    every = sum(p.numel() for p in mixed.parameters())
    assert pure.communication["all_gather"] == 2 * (2 * every) - 2 * units[""].params


def test_a_module_whose_own_trainable_parameters_mix_dtypes_is_refused_with_the_ways_out(shell):
    odd = nn.Linear(4, 4)
    odd.bias = nn.Parameter(odd.bias.detach().to(torch.bfloat16))
    with pytest.raises(ConfigError, match=r"holds trainable parameters stored in bfloat16 and float32 in one FSDP "
                       r"unit.*store them in one dtype, freeze the odd ones"):  # fmt: skip
        wrap_units(nn.Sequential(odd), FSDPConfig())
    odd.bias.requires_grad_(False)  # frozen ones may differ
    assert wrap_units(nn.Sequential(odd), FSDPConfig()) == []
    with pytest.raises(UsageError, match="mixed_precision param_dtype must be one of stored, fp32"):
        nbfsdp.explain(odd, mixed_precision={"param_dtype": "fp8"})
