"""``%fsdp explain --code``: the printed FSDP2 code, run on real ranks, is the same training as the cell.

Each case trains the notebook's model with ``%%fsdp`` and settings, then runs the code ``explain``
printed for those settings on a fresh model built the same way on the same ranks (plain
``fully_shard`` calls, nothing of nbfsdp's sharding), and compares the FSDP units, the losses of
every step on every rank, and the dtypes the units compute in.
"""

from __future__ import annotations

import pytest
import torch

import nbfsdp
from tests.conftest import run_ok

pytestmark = pytest.mark.timeout(240)

LOOP = """
opt = torch.optim.SGD({model}.parameters(), lr=0.1)
for step in range(4):
    x, y = batch_for(rank, step)
    loss = loss_fn({model}(x.to(device)).float(), y.to(device))  # bf16 under GPU's DEFAULT, the target fp32
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
"""

PRINTED_CODE_ON_THE_RANKS = (
    """%%fsdp --world-size WORLD_SIZE
from torch.distributed.fsdp import FSDPModule
torch.manual_seed(0)
plain = Net()  # the notebook's model was built the same way
exec(printed, {"model": plain})
"""
    + LOOP.format(model="plain")
    + """
units = [name for name, module in plain.named_modules() if isinstance(module, FSDPModule)]
param_dtype = plain.blocks[0]._get_fsdp_state()._fsdp_param_group.mp_policy.param_dtype
"""
)

CASES = {
    "defaults": "--wrap-cls Block",
    "everything": "--wrap-cls Block,Linear --sharding-strategy SHARD_GRAD_OP --mixed-precision PURE "
    "--forward-prefetch --backward-prefetch NONE --activation-checkpointing",
    "replicated": "--wrap-cls Block --sharding-strategy NO_SHARD",
}
#: Cases at world size 4: what needs more than 2 ranks.
CASES_AT_4 = {"reshard-to-2": "--wrap-cls Block --reshard-after-forward 2"}


def printed_code_against_the_cell(shell, capsys, settings: str, world_size: int) -> str:
    """Train with ``%%fsdp`` and ``settings``, then with the code explain prints for them; compare; the code."""
    run_ok(shell, f"%%fsdp --world-size {world_size} --no-gather {settings}\n" + LOOP.format(model="model"))
    cell = nbfsdp.last_run()
    capsys.readouterr()
    shell.run_line_magic("fsdp", f"explain --code --world-size {world_size} {settings} model")
    shell.user_ns["printed"] = printed = capsys.readouterr().out
    assert "fully_shard(model, mesh=mesh" in printed and "init_device_mesh" in printed

    run_ok(shell, PRINTED_CODE_ON_THE_RANKS.replace("WORLD_SIZE", str(world_size)))
    by_hand = nbfsdp.last_run()
    assert set(shell.user_ns["units"]) == {"", *cell.config["fsdp_units"]["model"]}  # rank 0's
    for rank in range(world_size):
        torch.testing.assert_close(by_hand.metric("loss", rank), cell.metric("loss", rank), rtol=0, atol=0)
    return printed


@pytest.mark.parametrize("case", CASES)
def test_printed_code_trains_like_the_cell(shell, tiny_model, capsys, case):
    printed_code_against_the_cell(shell, capsys, CASES[case], world_size=2)
    expected = torch.bfloat16 if "PURE" in CASES[case] else None  # FULL: as stored, fp32 for this fp32 model
    assert shell.user_ns["param_dtype"] == expected


@pytest.mark.parametrize("case", CASES_AT_4)
def test_printed_code_trains_like_the_cell_at_world_size_4(shell, tiny_model, capsys, case):
    printed = printed_code_against_the_cell(shell, capsys, CASES_AT_4[case], world_size=4)
    assert "fully_shard(block, mesh=mesh, reshard_after_forward=2" in printed


def test_the_code_says_each_setting(shell, tiny_model):
    plan = nbfsdp.explain(
        tiny_model,
        world_size=4,
        wrap_cls="Block",
        sharding_strategy="HYBRID_SHARD",
        replicas=2,
        cpu_offload=True,
        mixed_precision="DEFAULT",
    )
    code = plan.code
    assert 'init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))' in code
    assert "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)" in code
    assert "offload_policy = CPUOffloadPolicy(pin_memory=False)" in code
    assert "for block in model.blocks:\n    fully_shard(block, mesh=mesh, reshard_after_forward=True" in code
    assert "set_modules_to_forward_prefetch" not in code and "checkpoint(" not in code
    compile(code, "<explain --code>", "exec")


class _RegisteredLast(torch.nn.Module):
    """Registers ``last`` before ``first`` but runs ``first`` first: registration order is not forward order."""

    def __init__(self) -> None:
        super().__init__()
        self.last = torch.nn.Linear(8, 8)
        self.first = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x))


def test_the_code_names_the_order_its_units_list_has():
    model = _RegisteredLast()
    code = nbfsdp.explain(model, world_size=2, wrap_cls="Linear", forward_prefetch=True).code
    line = next(line for line in code.splitlines() if line.startswith("units = "))
    ran = []
    for name in ("last", "first"):
        model.get_submodule(name).register_forward_hook(lambda module, *_: ran.append(module))
    model(torch.randn(2, 8))
    namespace = {"model": model, "FSDPModule": torch.nn.Linear}  # the units, as fully_shard would have made them
    exec(line, namespace)
    assert namespace["units"] == [model.last, model.first] != ran  # model.modules(): registration, not forward
    assert "forward order" not in line  # the old comment called it forward order
    comment = code.splitlines()[code.splitlines().index(line) - 2]
    assert comment.startswith("# the units in registration order (model.modules())"), code
    assert "set_modules_to_forward_prefetch" in code
    compile(code, "<explain --code>", "exec")
