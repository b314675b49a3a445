"""FSDP settings in Composer's vocabulary, as FSDP2 runs them on real ranks."""

from __future__ import annotations

import copy

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.shared.config import COMPOSER_0_11_DEFAULT
from tests.conftest import one_process_losses, run_failing, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(240)]

STEPS = 3
TRAIN = """
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range({steps}):
    x, y = batch_for(rank, step, per_rank={per_rank})
    out = model(x.to(device))
    if step == 0:
        from torch.distributed.tensor import DTensor
        # a unit's parameters stay gathered between forward and backward only without resharding
        sharded_after_forward = isinstance(model.blocks[0].mlp[0].weight, DTensor)
    loss = loss_fn(out.float(), y.to(device))  # torch 2.6's mse_loss has no backward for bf16 out, fp32 y
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
local_rows = model.blocks[0].mlp[0].weight.to_local().shape[0]
"""


def _reference_losses(shell, model, world_size: int, per_rank: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return one_process_losses(shell, model, opt, world_size, STEPS, per_rank=per_rank)


def _train_and_compare(shell, model, flags: str, world_size: int = 2) -> None:
    """fp32 parity with one process on the same global batch: losses every step, parameters at the end."""
    per_rank = 8 // world_size
    reference = copy.deepcopy(model)
    run_ok(
        shell,
        f"%%fsdp --world-size {world_size} --mixed-precision FULL --wrap-cls Block {flags}\n"
        + TRAIN.format(steps=STEPS, per_rank=per_rank),
    )
    expected = _reference_losses(shell, reference, world_size, per_rank)
    run = nbfsdp.last_run()
    measured = [sum(run.metric("loss", r)[s] for r in range(world_size)) / world_size for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(expected))
    for (name, trained), (_, wanted) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, wanted, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    ("strategy", "world_size", "resharded", "rows"),
    [
        ("FULL_SHARD", 2, True, 16),  # 32 rows of blocks.0.mlp.0 split in 2
        ("SHARD_GRAD_OP", 2, False, 16),
        ("NO_SHARD", 2, True, 32),  # replicated: every rank holds all rows
        ("HYBRID_SHARD --replicas 2", 4, True, 16),  # 2 replicas x 2 shards
        ("FULL_SHARD --reshard-after-forward 2", 4, True, 8),  # kept in pairs between forward and backward
    ],
)
def test_each_sharding_strategy_trains_like_one_process(shell, tiny_model, strategy, world_size, resharded, rows):
    _train_and_compare(shell, tiny_model, f"--sharding-strategy {strategy}", world_size)
    assert shell.user_ns["sharded_after_forward"] is resharded
    assert shell.user_ns["local_rows"] == rows
    assert nbfsdp.last_run().config["sharding_strategy"] == strategy.split()[0]


@pytest.mark.parametrize(
    "flags",
    [
        "--activation-checkpointing",
        "--backward-prefetch NONE",
        "--backward-prefetch BACKWARD_PRE --forward-prefetch",
        "--cpu-offload",
        "--activation-cpu-offload",
        "--sharding-strategy SHARD_GRAD_OP --activation-checkpointing --forward-prefetch",
    ],
)
def test_settings_keep_fp32_parity(shell, tiny_model, flags):
    _train_and_compare(shell, tiny_model, flags)


DTYPES_SEEN = """%%fsdp --world-size 2 --wrap-cls Block {flags}
seen = {{}}
def record(module, args, output):
    seen.update(param=str(module.weight.dtype), activation=str(output.dtype))
hook = model.blocks[0].mlp[0].register_forward_hook(record)
x, y = batch_for(rank, 0)
loss = loss_fn(model(x).float(), y)
loss.backward()
hook.remove()
policy = model.blocks[0]._get_fsdp_state()._mp_policy  # what FSDP2 was given
# torch 2.6 stores reduce_dtype None where it equals param_dtype: gradients are then reduced in param_dtype
reduce = policy.reduce_dtype or policy.param_dtype
seen.update(reduce=str(reduce), buffer=str(model.blocks[0].norm.weight.dtype))
"""


@pytest.mark.parametrize(
    ("preset", "param", "reduce"),
    [
        ("FULL", "torch.float32", "torch.float32"),
        ("DEFAULT", "torch.bfloat16", "torch.float32"),
        ("PURE", "torch.bfloat16", "torch.bfloat16"),
    ],
)
def test_mixed_precision_presets_set_the_dtypes_used_in_forward_and_reduction(shell, tiny_model, preset, param, reduce):
    run_ok(shell, DTYPES_SEEN.format(flags=f"--mixed-precision {preset}"))
    seen = shell.user_ns["seen"]
    assert seen["param"] == param and seen["activation"] == param
    assert seen["reduce"] == reduce
    assert nbfsdp.last_run().config["mixed_precision"] == preset


def test_a_mixed_precision_dict_from_composer(shell, tiny_model):
    shell.user_ns["mp_config"] = {
        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    }
    run_ok(shell, DTYPES_SEEN.format(flags="--config mp_config"))
    assert shell.user_ns["seen"]["param"] == "torch.bfloat16"
    assert shell.user_ns["seen"]["reduce"] == "torch.float32"


UNITS_AND_CHECKPOINTS = """%%fsdp --world-size 2 {flags}
from torch.distributed.fsdp import FSDPModule
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import _get_registry
units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
hooked = [(n, m) for n, m in model.named_modules() if "checkpoint" in (_get_registry(m) or {{}})]
checkpointed = [n for n, m in hooked if checkpoint.state(m).enable_hook]
"""


def _units_and_checkpoints(shell, flags: str) -> tuple[list[str], list[str]]:
    run_ok(shell, UNITS_AND_CHECKPOINTS.format(flags=flags))
    return shell.user_ns["units"], shell.user_ns["checkpointed"]


def test_wrap_rules_in_composer_order(shell, tiny_model):
    assert _units_and_checkpoints(shell, "")[0] == [""]  # min_params 1e8: only the root
    assert _units_and_checkpoints(shell, "--min-params 1000")[0] == ["", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]
    nested = [f"blocks.{i}{part}" for i in range(3) for part in ("", ".mlp.0", ".mlp.2")]
    assert _units_and_checkpoints(shell, "--wrap-cls Block,Linear")[0] == ["", "embed", *nested, "head"]
    tiny_model.blocks[1]._fsdp_wrap = False  # the attribute wins over every other rule
    tiny_model.head._fsdp_wrap = True
    assert _units_and_checkpoints(shell, "--wrap-cls Block")[0] == ["", "blocks.0", "blocks.2", "head"]
    del tiny_model.blocks[1]._fsdp_wrap, tiny_model.head._fsdp_wrap
    type(tiny_model).fsdp_wrap_fn = lambda self, module: module is self.embed  # the root decides
    try:
        assert _units_and_checkpoints(shell, "")[0] == ["", "embed"]
    finally:
        del type(tiny_model).fsdp_wrap_fn


def test_checkpointing_rules_in_composer_order(shell, tiny_model):
    assert _units_and_checkpoints(shell, "--wrap-cls Block")[1] == []
    _, checkpointed = _units_and_checkpoints(shell, "--wrap-cls Block --activation-checkpointing")
    assert checkpointed == ["blocks.0", "blocks.1", "blocks.2"]  # by default: the units
    type(tiny_model).activation_checkpointing_fn = lambda self, module: module in (self.embed, self.head)
    tiny_model.head._activation_checkpointing = False  # the attribute wins
    try:
        _, checkpointed = _units_and_checkpoints(shell, "--wrap-cls Block --activation-checkpointing")
        assert checkpointed == ["embed"]
    finally:
        del type(tiny_model).activation_checkpointing_fn, tiny_model.head._activation_checkpointing


COMPOSER_DOCS_CONFIG = {  # as Composer's FSDP docs show it
    "sharding_strategy": "FULL_SHARD",
    "cpu_offload": False,
    "mixed_precision": "DEFAULT",
    "backward_prefetch": "BACKWARD_POST",
    "activation_checkpointing": False,
    "activation_cpu_offload": False,
    "verbose": True,
    "limit_all_gathers": True,
    "state_dict_type": "full",
    "forward_prefetch": False,
    "min_params": 1e8,
    "use_orig_params": True,
}


def test_a_composer_fsdp_config_is_accepted_unchanged_and_flags_win(shell, tiny_model, capsys):
    shell.user_ns["fsdp_config"] = dict(COMPOSER_DOCS_CONFIG)
    run_ok(
        shell,
        "%%fsdp --world-size 2 --config fsdp_config --sharding-strategy SHARD_GRAD_OP\n"
        # DEFAULT computes in bf16: the loss in fp32 (torch 2.6's mse_loss refuses a bf16 output and fp32 targets)
        "x, y = batch_for(rank, 0)\nloss_fn(model(x).float(), y).backward()\n",
    )
    assert "nbfsdp: BACKWARD_POST asked, which FSDP2 does not have" in capsys.readouterr().err  # asked explicitly
    config = nbfsdp.last_run().config
    assert config["sharding_strategy"] == "SHARD_GRAD_OP"  # the flag
    assert config["mixed_precision"] == "DEFAULT" and config["min_params"] == int(1e8)  # the dict
    assert config["backward_prefetch"] == "BACKWARD_PRE"  # what FSDP2 actually does
    assert set(config["ignored"]) == {"verbose", "limit_all_gathers", "state_dict_type", "use_orig_params"}
    assert shell.user_ns["fsdp_config"] == COMPOSER_DOCS_CONFIG  # the notebook's dict untouched


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"sharding_strategy": "ZERO3"}, "sharding_strategy must be one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD"),
        ({"shard_everything": True}, "unknown fsdp_config key 'shard_everything'; valid keys:"),
        ({"mixed_precision": {"param_dtype": "fp8"}}, "mixed_precision param_dtype must be one of"),
        ({"mixed_precision": {"grad_dtype": "bf16"}}, "mixed_precision dict keys are param_dtype, reduce_dtype"),
        ([("sharding_strategy", "FULL_SHARD")], "is a list, not a dict"),
    ],
)
def test_bad_config_values_are_rejected_before_anything_runs(shell, config, message):
    shell.user_ns["bad_config"] = config
    runs_before = len(nbfsdp.runs())
    error, elapsed = run_failing(shell, "%%fsdp --world-size 2 --config bad_config\npass\n")
    assert isinstance(error, UsageError) and message in str(error), str(error)
    assert elapsed < 1 and len(nbfsdp.runs()) == runs_before


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--world-size 4 --reshard-after-forward 3", "must divide the 4 ranks a unit is sharded over, other than 1 "
         "and 4: one of 2; got 3"),
        ("--world-size 4 --reshard-after-forward 4", "one of 2; got 4"),
        ("--world-size 2 --reshard-after-forward 2", "none at 2 (4 ranks or more); got 2"),
        ("--world-size 4 --sharding-strategy SHARD_GRAD_OP --reshard-after-forward 2",
         "needs FULL_SHARD or HYBRID_SHARD (with SHARD_GRAD_OP a unit stays gathered after forward)"),
        ("--world-size 4 --reshard-after-forward 0", "one of 2; got 0"),
    ],
)  # fmt: skip
def test_a_reshard_group_that_cannot_be_made_is_refused_naming_those_that_can(shell, tiny_model, flags, message):
    runs_before = len(nbfsdp.runs())
    error, elapsed = run_failing(shell, f"%%fsdp {flags}\npass\n")
    assert isinstance(error, UsageError) and message in str(error), str(error)
    assert elapsed < 1 and len(nbfsdp.runs()) == runs_before


def test_a_module_reached_by_two_paths_is_a_clear_error(shell, tiny_model):
    tiny_model.shared = tiny_model.blocks[0]
    try:
        error, _ = run_failing(shell, "%%fsdp --world-size 2\npass\nmodel\n")
        assert isinstance(error, UsageError)
        assert "model.blocks.0 and model.shared are the same module" in str(error)
    finally:
        del tiny_model.shared


@pytest.mark.parametrize("preset", ["DEFAULT", "PURE", "COMPOSER_0_11_DEFAULT"])
def test_low_precision_loss_stays_within_bf16_tolerance_of_a_reference_with_the_same_casts(shell, tiny_model, preset):
    master = copy.deepcopy(tiny_model)
    shell.user_ns["composer_0_11"] = {"mixed_precision": COMPOSER_0_11_DEFAULT}
    flags = "--config composer_0_11" if preset == "COMPOSER_0_11_DEFAULT" else f"--mixed-precision {preset}"
    run_ok(shell, f"%%fsdp --world-size 2 --wrap-cls Block {flags}\n" + TRAIN.format(steps=STEPS, per_rank=4))
    del shell.user_ns["composer_0_11"]
    run = nbfsdp.last_run()
    measured = [(run.metric("loss", 0)[s] + run.metric("loss", 1)[s]) / 2 for s in range(STEPS)]

    ns = shell.user_ns
    opt = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    expected = []
    for step in range(STEPS):
        batches = [ns["batch_for"](rank, step, per_rank=4) for rank in range(2)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        if preset != "COMPOSER_0_11_DEFAULT":  # forward and backward on a bf16 copy; fp32 master weights step
            low = copy.deepcopy(master).to(torch.bfloat16)
            loss = ns["loss_fn"](low(x.to(torch.bfloat16)).float(), y)
            loss.backward()
            for param, low_param in zip(master.parameters(), low.parameters(), strict=True):
                param.grad = low_param.grad.float()
        else:  # Composer 0.11's DEFAULT: fp32 compute; gradients averaged in bf16
            loss = ns["loss_fn"](master(x), y)
            loss.backward()
            for param in master.parameters():
                param.grad = param.grad.to(torch.bfloat16).float()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(expected), rtol=1.6e-2, atol=1e-5)


def test_full_shard_gathers_the_root_once_a_step_as_explain_counts(shell, tiny_model):
    """FSDP2 leaves the root gathered from forward into backward; the blocks are resharded."""
    run_ok(
        shell,
        """%%fsdp --world-size 2 --wrap-cls Block
from torch.distributed.tensor import DTensor
x, y = batch_for(rank, 0)
out = model(x)
root_gathered = not isinstance(model.embed.weight, DTensor)
block_gathered = not isinstance(model.blocks[0].mlp[0].weight, DTensor)
loss_fn(out, y).backward()
""",
    )
    assert shell.user_ns["root_gathered"] is True and shell.user_ns["block_gathered"] is False


def test_the_size_rule_skips_containers_without_forward_and_explicit_rules_are_refused(shell, tiny_model):
    # the blocks' ModuleList reaches 2,000 parameters before any Block (1,104) does: FSDP1's size
    # policy skipped such containers, and FSDP2 cannot shard one, so its parameters go to the root
    assert _units_and_checkpoints(shell, "--min-params 2000")[0] == [""]
    runs_before = len(nbfsdp.runs())
    error, _ = run_failing(shell, "%%fsdp --world-size 2 --wrap-cls ModuleList\nmodel\n")
    assert isinstance(error, UsageError)
    assert "blocks (ModuleList) has no forward, so FSDP2 cannot make it a unit" in str(error)
    assert len(nbfsdp.runs()) == runs_before
    assert "has no forward" in str(pytest.raises(UsageError, nbfsdp.explain, tiny_model, wrap_cls="ModuleList").value)
