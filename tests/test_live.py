"""Steering a running cell: settings toggled mid-run, cancel, --async, and panel defaults.

The changes are made from another thread while the cell runs, as the
dashboard's controls and Stop button make them (the same session methods).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from nbfsdp.kernel.magics import settings_panel
from tests.conftest import run_failing, run_ok

pytestmark = [pytest.mark.floor, pytest.mark.timeout(240)]

STEPS = 12

TRAIN = """%%fsdp --world-size 2 --wrap-cls Block --mixed-precision FULL {flags}
import time
from torch.distributed._composable import checkpoint
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range({steps}):
    x, y = batch_for(rank, step)
    out = model(x)
    loss = loss_fn(out.float(), y)
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(
        step=step, loss=loss.item(), dtype=str(out.dtype),
        checkpointing=checkpoint.state(model.blocks[0]).enable_hook,
        reshard=model.blocks[0]._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None,
    )
    time.sleep(0.15)
adam_steps = {{s["step"].item() for s in opt.state.values()}}
"""


def _session():
    return nbfsdp._magics.session


@pytest.fixture(autouse=True)
def no_run_left_behind(shell):
    """A failed test here must not leave an --async run that makes every later cell a UsageError."""
    yield
    if _session().active is not None:
        _session().active.ranks.interrupt()  # ends it now, log calls or not
        with contextlib.suppress(BaseException):  # the interrupt it ends with
            shell.run_line_magic("fsdp", "wait")
    _session().panel.clear()


def _after(seconds: float, action) -> threading.Thread:
    """Run ``action`` once the next cell has been running (on the ranks) for ``seconds``."""

    def wait_then_act() -> None:
        deadline = time.monotonic() + 120
        while _session().active is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=wait_then_act)
    thread.start()
    return thread


def _change_step(run) -> int:
    """The first step the change was in force: the same on every rank (applied as its forward began)."""
    steps = {m["rank"]: m["step"] for m in run.metrics if "changed" in m}
    assert sorted(steps) == [0, 1], run.metrics
    assert len(set(steps.values())) == 1, steps
    return steps[0]


def _reference(shell, model, low_from: int | None = None) -> list[float]:
    """One process, AdamW, the global batch; from step ``low_from`` on, PURE bf16 casts as FSDP2 makes them."""
    ns = shell.user_ns
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        batches = [ns["batch_for"](rank, step) for rank in range(2)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        if low_from is not None and step >= low_from:  # forward and backward on a bf16 copy; fp32 weights step
            low = copy.deepcopy(model).to(torch.bfloat16)
            loss = ns["loss_fn"](low(x.to(torch.bfloat16)).float(), y)
            loss.backward()
            for param, low_param in zip(model.parameters(), low.parameters(), strict=True):
                param.grad = low_param.grad.float()
        else:
            loss = ns["loss_fn"](model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _mean_losses(run) -> list[float]:
    return [(run.metric("loss", 0)[s] + run.metric("loss", 1)[s]) / 2 for s in range(STEPS)]


def test_toggles_apply_on_every_rank_at_one_step_and_training_stays_exact(shell, tiny_model):
    reference = copy.deepcopy(tiny_model)
    change = {
        "activation_checkpointing": True,
        "sharding_strategy": "SHARD_GRAD_OP",
        "forward_prefetch": True,
        "backward_prefetch": "NONE",
    }
    timer = _after(1.0, lambda: _session().change_settings(change))
    run_ok(shell, TRAIN.format(flags="", steps=STEPS))
    timer.join()
    run = nbfsdp.last_run()
    switched = _change_step(run)
    assert 0 < switched < STEPS - 1, "the change came while the cell ran"
    for rank in (0, 1):
        assert run.metric("checkpointing", rank) == [s >= switched for s in range(STEPS)]
        assert run.metric("reshard", rank) == [s < switched for s in range(STEPS)]  # ZeRO-3, then ZeRO-2
    assert [step for step, _ in run.changes] == [switched]
    assert (
        "activation_checkpointing=True" in run.changes[0][1] and "sharding_strategy=SHARD_GRAD_OP" in run.changes[0][1]
    )
    assert shell.user_ns["adam_steps"] == {float(STEPS)}  # one optimizer, never restarted
    assert nbfsdp.compare(1)[0]["changes"] == [f"step {switched}: {run.changes[0][1]}"]
    assert "changed mid-run" in nbfsdp.kernel.comparison.table(nbfsdp.compare(1)).splitlines()[0]
    # the same math as one process, the setting changed or not (fp32)
    torch.testing.assert_close(torch.tensor(_mean_losses(run)), torch.tensor(_reference(shell, reference)))
    for (name, trained), (_, expected) in zip(tiny_model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, expected, msg=lambda m, name=name: f"{name}: {m}")


def test_mixed_precision_switched_mid_run_follows_a_run_that_used_it_from_that_step(shell, tiny_model):
    reference = copy.deepcopy(tiny_model)
    timer = _after(1.0, lambda: _session().change_settings({"mixed_precision": "PURE"}))
    run_ok(shell, TRAIN.format(flags="", steps=STEPS))
    timer.join()
    run = nbfsdp.last_run()
    switched = _change_step(run)
    for rank in (0, 1):
        assert run.metric("dtype", rank) == [
            "torch.bfloat16" if s >= switched else "torch.float32" for s in range(STEPS)
        ]
    assert shell.user_ns["adam_steps"] == {float(STEPS)}
    expected = _reference(shell, reference, low_from=switched)
    measured = _mean_losses(run)
    # fp32 until the switch, exactly; then within bf16 tolerance of the same casts
    torch.testing.assert_close(torch.tensor(measured[:switched]), torch.tensor(expected[:switched]))
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(expected), rtol=1.6e-2, atol=1e-5)


def test_a_change_that_needs_another_mesh_waits_for_the_next_cell(shell, tiny_model):
    messages = []
    timer = _after(1.0, lambda: messages.append(_session().change_settings({"sharding_strategy": "NO_SHARD"})))
    run_ok(shell, TRAIN.format(flags="", steps=8))
    timer.join()
    assert messages == ["sharding_strategy: from the next cell"]
    assert not nbfsdp.last_run().changes
    run_ok(shell, "%%fsdp --world-size 2\nrows = model.blocks[0].mlp[0].weight.to_local().shape[0]\n")
    assert nbfsdp.last_run().config["sharding_strategy"] == "NO_SHARD"
    assert shell.user_ns["rows"] == 32  # replicated: all 32 rows on every rank


def test_cancel_ends_every_rank_at_one_step_and_the_cell_finishes_cleanly(shell, tiny_model):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    shell.user_ns.pop("step", None)
    timer = _after(1.5, _session().cancel)
    started = time.monotonic()
    run_ok(shell, TRAIN.format(flags="", steps=200))  # 200 steps would take 30 s
    timer.join()
    assert time.monotonic() - started < 10
    run = nbfsdp.last_run()
    assert run.ok and run.cancelled
    last = {rank: run.metric("step", rank)[-1] for rank in (0, 1)}
    assert last[0] == last[1] < 199
    # a cancelled cell ends as a finished one: trained weights gathered, names assigned so far back
    assert any(not torch.equal(p.detach(), before[n]) for n, p in tiny_model.named_parameters())
    assert shell.user_ns["step"] == last[0] + 1  # cancelled as that step's forward began


def test_async_returns_at_once_and_wait_brings_every_step(shell, tiny_model):
    run_ok(shell, "%%fsdp --world-size 2\npass\n")  # a running cluster (a session's first cell starts it first)
    shell.user_ns.pop("adam_steps", None)
    started = time.monotonic()
    run_ok(shell, TRAIN.format(flags="--async", steps=STEPS))
    assert time.monotonic() - started < 2
    assert "adam_steps" not in shell.user_ns  # still training
    error, _ = run_failing(shell, "%%fsdp --world-size 2\npass\n")
    assert isinstance(error, UsageError) and "%fsdp wait" in str(error)
    deadline = time.monotonic() + 30
    while not nbfsdp.last_run().metrics:  # the records arrive in last_run() while it trains
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _session().active is not None and nbfsdp.last_run().metrics[0]["step"] == 0
    shell.run_line_magic("fsdp", "wait")
    run = nbfsdp.last_run()
    assert run.ok and [m["step"] for m in run.metrics if m["rank"] == 0] == list(range(STEPS))
    assert shell.user_ns["adam_steps"] == {float(STEPS)}  # names back, as a blocking cell
    run_ok(shell, "%%fsdp --world-size 2\nafter = rank\n")  # and the cluster is free again
    assert shell.user_ns["after"] == 0


def test_an_async_run_can_be_cancelled(shell, tiny_model):
    run_ok(shell, TRAIN.format(flags="--async", steps=200))
    time.sleep(1.5)
    shell.run_line_magic("fsdp", "cancel")
    started = time.monotonic()
    shell.run_line_magic("fsdp", "wait")
    assert time.monotonic() - started < 5
    assert nbfsdp.last_run().cancelled and nbfsdp.last_run().ok


def test_panel_settings_become_the_next_cells_defaults_and_flags_still_win(shell, tiny_model):
    panel = settings_panel(_session(), tiny_model, 2)
    assert "params float32" in panel.plan.value
    panel.controls.widgets["mixed_precision"].value = "PURE"  # as a person picks it
    panel.controls.widgets["activation_checkpointing"].value = True
    assert "params bfloat16" in panel.plan.value  # the plan beside the controls follows
    try:
        run_ok(shell, "%%fsdp --world-size 2\npass\n")
        config = nbfsdp.last_run().config
        assert config["mixed_precision"] == "PURE" and config["activation_checkpointing"] is True
        run_ok(shell, "%%fsdp --world-size 2 --mixed-precision FULL\npass\n")
        config = nbfsdp.last_run().config
        assert config["mixed_precision"] == "FULL" and config["activation_checkpointing"] is True
        shell.user_ns["composer"] = {"mixed_precision": "DEFAULT"}
        run_ok(shell, "%%fsdp --world-size 2 --config composer\npass\n")
        assert nbfsdp.last_run().config["mixed_precision"] == "DEFAULT"  # --config wins over the panel
    finally:
        _session().panel.clear()


def test_the_panels_device_control_plans_for_gpus_and_is_the_next_cells_default(shell, tiny_model):
    """The device control shows what was asked (auto), not what auto chose; picking cuda plans for GPUs (this
    kernel has none: the plan says so) and makes the next cell ask for them, which here fails before it runs."""
    panel = settings_panel(_session(), tiny_model, 2)
    assert panel.controls.widgets["device"].value == "auto" and "2 ranks on the CPU (gloo)" in panel.plan.value
    try:
        panel.controls.widgets["device"].value = "cuda"  # as a person picks it
        assert "2 ranks, a GPU each (planned: this kernel sees no GPU)" in panel.plan.value
        assert "params bfloat16, reduce float32" in panel.plan.value  # Composer's DEFAULT on GPU
        error, _ = run_failing(shell, "%%fsdp --world-size 2\npass\n")
        assert isinstance(error, UsageError) and str(error).startswith("--device cuda: this machine has no GPU")
        run_ok(shell, "%%fsdp --world-size 2 --device cpu\npass\n")  # the flag wins over the panel
        assert nbfsdp.last_run().config["devices"] == "2 ranks on the CPU (gloo)"
    finally:
        _session().panel.clear()


def test_set_changes_an_async_run_mid_run(shell, tiny_model, capsys):
    run_ok(shell, TRAIN.format(flags="--async", steps=STEPS))
    while not nbfsdp.last_run().metrics:
        time.sleep(0.05)  # the ranks are training
    shell.run_line_magic("fsdp", "set activation_checkpointing=true")
    assert "requested activation_checkpointing=True (from the next step)" in capsys.readouterr().out
    shell.run_line_magic("fsdp", "wait")
    run = nbfsdp.last_run()
    switched = _change_step(run)
    assert run.metric("checkpointing", 0) == [s >= switched for s in range(STEPS)]


ONE_RANK_LOGS = """%%fsdp --world-size 2 --wrap-cls Block --mixed-precision FULL --async
import time
import torch.distributed as dist
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
dtypes = []
for step in range({steps}):
    x, y = batch_for(rank, step)
    out = model(x)
    dtypes.append(str(out.dtype))
    loss_fn(out.float(), y).backward(); opt.step(); opt.zero_grad()
    if {logs}:
        nbfsdp.log(step=step, loss=loss_fn(out.float(), y).item())
    time.sleep(0.1)
every_rank = [None] * world_size
dist.all_gather_object(every_rank, dtypes)
"""


@pytest.mark.parametrize("logs", ["rank == 0", "False"], ids=["rank-0-logs", "no-rank-logs"])
def test_a_change_applies_on_every_rank_however_the_cell_logs(shell, tiny_model, logs):
    """The step boundary is each forward, which every rank runs: a cell logging on one rank, or none, switches
    every rank at the same step (at a log call only rank 0 would switch, and the ranks' collectives would part)."""
    run_ok(shell, ONE_RANK_LOGS.format(steps=20, logs=logs))
    time.sleep(1.5)  # the ranks are some steps in
    shell.run_line_magic("fsdp", "set mixed_precision=PURE")
    shell.run_line_magic("fsdp", "wait")
    run = nbfsdp.last_run()
    assert run.ok
    first, second = shell.user_ns["every_rank"]
    assert first == second, (first, second)  # both ranks computed in bf16 from the same step
    switched = first.index("torch.bfloat16")
    assert switched > 0 and set(first[switched:]) == {"torch.bfloat16"}, first
    if logs == "rank == 0":
        assert [step for step, _ in run.changes] == [switched]


def test_a_cell_that_never_logs_is_cancelled_on_every_rank(shell, tiny_model):
    run_ok(shell, ONE_RANK_LOGS.format(steps=300, logs="False"))
    time.sleep(1.0)
    started = time.monotonic()
    shell.run_line_magic("fsdp", "cancel")
    shell.run_line_magic("fsdp", "wait")
    assert time.monotonic() - started < 20  # 300 steps would take 30 s and more
    run = nbfsdp.last_run()
    assert run.ok and run.cancelled
