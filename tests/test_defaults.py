"""Defaults that are the same math as one process: what a cell without FSDP flags runs, and what it prints."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import nbfsdp
from nbfsdp.shared.config import COMPOSER_0_11_DEFAULT, FSDPConfig, for_device
from nbfsdp.shared.devices import Devices
from tests.conftest import TINY_MODEL, run_failing, run_ok
from tests.test_config import DTYPES_SEEN
from tests.test_kernel import Kernel

pytestmark = pytest.mark.timeout(240)

STEPS = 5
TRAIN = """%%fsdp --world-size 2{flags}
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range({steps}):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
del opt
"""
POST_LINE = re.compile(r"^nbfsdp: BACKWARD_POST asked, which FSDP2 does not have .*BACKWARD_PRE\)$")


def test_a_cell_without_fsdp_flags_is_one_process_training_on_cpu(shell, tiny_model):
    reference = copy.deepcopy(tiny_model)
    run_ok(shell, TRAIN.format(flags="", steps=STEPS))
    ns = shell.user_ns
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for step in range(STEPS):
        batches = [ns["batch_for"](rank, step) for rank in range(2)]
        loss = ns["loss_fn"](reference(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    run = nbfsdp.last_run()
    measured = [(run.metric("loss", 0)[s] + run.metric("loss", 1)[s]) / 2 for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(expected))
    for (name, trained), (_, wanted) in zip(tiny_model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, wanted, msg=lambda m, name=name: f"{name}: {m}")
    assert run.config["mixed_precision"] == "FULL" and run.config["backward_prefetch"] == "BACKWARD_PRE"
    assert "one process's math on CPU: fp32 for an fp32 model" in run.config["why"]["mixed_precision"]
    assert "Composer's default BACKWARD_POST" in run.config["why"]["backward_prefetch"]


def _seen_after(shell, flags: str) -> tuple[dict, dict]:
    run_ok(shell, DTYPES_SEEN.format(flags=flags))
    return shell.user_ns["seen"], nbfsdp.last_run().config


def test_low_precision_asked_by_name_is_bf16_on_cpu_by_flag_dict_and_set(shell, tiny_model):
    session = nbfsdp._magics.session
    shell.user_ns["composer"] = {"mixed_precision": "PURE"}
    try:
        seen, config = _seen_after(shell, "--mixed-precision DEFAULT")
        assert (seen["param"], seen["reduce"], config["mixed_precision"]) == (
            "torch.bfloat16",
            "torch.float32",
            "DEFAULT",
        )
        seen, config = _seen_after(shell, "--config composer")
        assert (seen["param"], seen["reduce"], config["mixed_precision"]) == (
            "torch.bfloat16",
            "torch.bfloat16",
            "PURE",
        )
        shell.run_line_magic("fsdp", "set mixed_precision=DEFAULT")
        seen, config = _seen_after(shell, "")
        assert (seen["param"], seen["reduce"], config["mixed_precision"]) == (
            "torch.bfloat16",
            "torch.float32",
            "DEFAULT",
        )
        assert "mixed_precision" not in config["why"]  # asked for: nothing to explain
        session.panel.clear()
        seen, config = _seen_after(shell, "")
        assert (seen["param"], seen["reduce"], config["mixed_precision"]) == ("torch.float32", "torch.float32", "FULL")
    finally:
        session.panel.clear()
        del shell.user_ns["composer"]


def test_explain_and_the_run_record_say_what_applied_and_why(shell, tiny_model, capsys):
    shell.run_line_magic("fsdp", "explain model")
    out, err = capsys.readouterr()
    assert "mixed precision FULL (params float32, reduce float32, buffers as stored)" in out  # it has no buffers
    assert "mixed precision FULL: not given; one process's math on CPU: fp32 for an fp32 model" in out
    assert "backward prefetch BACKWARD_PRE: not given; Composer's default BACKWARD_POST" in out
    assert err == ""

    shell.run_line_magic("fsdp", "explain --mixed-precision DEFAULT --backward-prefetch BACKWARD_POST model")
    out, err = capsys.readouterr()
    assert "mixed precision DEFAULT (params bfloat16, reduce float32, buffers float32)" in out
    assert "mixed precision DEFAULT:" not in out
    assert "backward prefetch BACKWARD_PRE: BACKWARD_POST asked, which FSDP2 does not have" in out
    assert POST_LINE.match(err.strip()) and len(err.splitlines()) == 1, err

    plan = nbfsdp.explain(tiny_model, world_size=2)
    assert plan.config["mixed_precision"] == "FULL" and set(plan.config["why"]) == {
        "mixed_precision",
        "backward_prefetch",
    }


def test_gpu_keeps_composers_fsdp2_default_and_so_does_a_precision_given_on_cpu():
    """Where the device is known: no GPU needed to check what one would get. DEFAULT is Composer's FSDP2 code's
    (``get_mixed_precision``) and torchtitan's: low-precision parameters, fp32 reduction, fp32 buffers."""
    on_gpu = for_device(FSDPConfig(), Devices("cuda", 2, 2))
    assert (on_gpu.mixed_precision, on_gpu.dtypes()) == ("DEFAULT", (torch.bfloat16, torch.float32, torch.float32))
    assert on_gpu.why["mixed_precision"] == (
        "not given; Composer's default on GPU: bf16 parameters (the compute), gradients reduced in fp32"
    )
    assert on_gpu.device == "cuda"
    asked = for_device(FSDPConfig(precision="fp16"), Devices("cpu", 2))  # Composer's precision is no longer fp32
    assert (asked.mixed_precision, asked.dtypes()) == ("DEFAULT", (torch.float16, torch.float32, torch.float32))
    assert asked.why["mixed_precision"].endswith(
        "once a precision is given: fp16 parameters (the compute), gradients reduced in fp32"
    )
    assert for_device(FSDPConfig(mixed_precision="PURE"), Devices("cuda", 2, 2)).why.keys() == {"backward_prefetch"}
    assert for_device(FSDPConfig(backward_prefetch="NONE"), Devices("cpu", 2)).why.keys() == {"mixed_precision"}
    # FULL and PURE unchanged; Composer 0.11's documented DEFAULT is a dict away
    assert for_device(FSDPConfig(mixed_precision="FULL"), Devices("cuda", 1, 1)).dtypes() == (None, torch.float32, None)
    assert for_device(FSDPConfig(mixed_precision="PURE"), Devices("cuda", 1, 1)).dtypes() == (torch.bfloat16,) * 3
    old = for_device(FSDPConfig(mixed_precision=COMPOSER_0_11_DEFAULT), Devices("cuda", 1, 1))
    assert old.dtypes() == (torch.float32, torch.bfloat16, torch.float32)


def test_explicit_backward_post_is_one_plain_line_from_a_dict_or_set(shell, tiny_model, capsys):
    session = nbfsdp._magics.session
    shell.user_ns["composer"] = {"backward_prefetch": "BACKWARD_POST"}
    try:
        for flags, before in ((" --config composer", ""), ("", "%fsdp set backward_prefetch=BACKWARD_POST")):
            if before:
                shell.run_line_magic("fsdp", before.removeprefix("%fsdp "))
            capsys.readouterr()
            run_ok(shell, f"%%fsdp --world-size 2{flags}\nx, y = batch_for(rank, 0)\nloss_fn(model(x), y).backward()\n")
            err = capsys.readouterr().err
            assert len(err.splitlines()) == 1 and POST_LINE.match(err.strip()), err
            why = nbfsdp.last_run().config["why"]["backward_prefetch"]
            assert (
                why.startswith("BACKWARD_POST asked")
                and nbfsdp.last_run().config["backward_prefetch"] == "BACKWARD_PRE"
            )
    finally:
        session.panel.clear()
        del shell.user_ns["composer"]


def _streams(messages: list) -> dict[str, str]:
    out = {"stdout": "", "stderr": ""}
    for _, msg in messages:
        if msg["msg_type"] == "stream":
            out[msg["content"]["name"]] += msg["content"]["text"]
    return out


@pytest.mark.slow  # a kernel of its own
def test_in_a_kernel_a_default_cell_prints_nothing_and_an_explicit_backward_post_one_line():
    kernel = Kernel()
    try:
        reply, _ = kernel.execute("%load_ext nbfsdp\n" + TINY_MODEL + "\ntorch.manual_seed(0)\nmodel = Net()\n")
        assert reply["content"]["status"] == "ok"
        for cell in ("first, starting the cluster", "warm"):
            reply, messages = kernel.execute(TRAIN.format(flags="", steps=3))
            assert reply["content"]["status"] == "ok", (cell, reply["content"])
            assert _streams(messages) == {"stdout": "", "stderr": ""}, cell  # no warning, no path, no note
        reply, messages = kernel.execute(TRAIN.format(flags=" --backward-prefetch BACKWARD_POST", steps=3))
        assert reply["content"]["status"] == "ok"
        streams = _streams(messages)
        assert streams["stdout"] == "" and POST_LINE.match(streams["stderr"].strip()), streams
        assert len(streams["stderr"].splitlines()) == 1 and "Warning" not in streams["stderr"]
    finally:
        kernel.shutdown()


def test_a_loss_against_fp32_targets_under_bf16_compute_says_what_to_do(shell, tiny_model):
    """DEFAULT computes in bf16 (on GPU by default), and FSDP2 leaves the model's output in bf16: on a GPU an
    MSE against fp32 targets fails in backward with the error raised here (as CUDA's mse_loss raised it on a
    lent H100; the CPU kernel accepts the mix). The error says why and what to do."""
    failing = "raise RuntimeError('Found dtype Float but expected BFloat16')\n"
    error, _ = run_failing(shell, f"%%fsdp --world-size 2 --mixed-precision DEFAULT\n{failing}")
    assert str(error).startswith("rank 0: RuntimeError: Found dtype Float but expected BFloat16; "), error
    assert (
        "under mixed precision DEFAULT the model computes in bf16 and its output stays bf16: compute the loss "
        "in fp32 (loss_fn(model(x).float(), y)) or under torch.autocast, or run the cell with --mixed-precision "
        "FULL" in str(error)
    ), error
    error, _ = run_failing(shell, f"%%fsdp --world-size 2 --mixed-precision FULL\n{failing}")
    assert "computes in" not in str(error)  # fp32 compute: nothing to say about precision
