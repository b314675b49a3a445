"""fp16 where there is no bf16 (issue 44, point 3): the rule as a function of the GPUs' compute capability, the
defaults and the one line it fills in, nbfsdp's loss scaling on FSDP2's DTensor gradients in a plain loop on
CPU ranks (torch runs FSDP2 in fp16 on gloo) against one process's GradScaler, the ranks skipping an overflowed
step together, and a loop's own GradScaler refused in one line. The same loop on a GPU where there is one."""

from __future__ import annotations

import copy

import pytest
import torch

import nbfsdp
from nbfsdp.engines.scaling import TWICE
from nbfsdp.kernel.cluster.hosts import devices, place
from nbfsdp.shared.config import FSDPConfig, for_device, validate
from nbfsdp.shared.devices import Devices, choose, gpu_capability, low_precision_for, on_gpus
from nbfsdp.shared.protocol import HostIdentity
from tests.conftest import gpu, run_failing, run_ok

T4, A100 = (7, 5), (8, 0)


def test_gpus_below_compute_capability_8_get_fp16_and_the_others_bf16():
    assert [low_precision_for(c) for c in [(6, 1), (7, 0), T4, A100, (8, 6), (9, 0)]] == ["fp16"] * 3 + ["bf16"] * 3
    assert low_precision_for(None) == "bf16"  # the CPU, or GPUs planned for and not seen


def test_default_is_fp16_parameters_fp32_reduction_on_a_t4_saying_why_and_bf16_on_an_a100():
    on_t4 = validate(FSDPConfig(), 2, on_gpus(2, 2, capability=T4))
    assert (on_t4.mixed_precision, on_t4.precision) == ("DEFAULT", "fp16")
    assert on_t4.dtypes() == (torch.float16, torch.float32, torch.float32)
    assert on_t4.why["precision"] == (
        "not given; GPUs of compute capability 7.5 have no bf16 (it needs 8.0): fp16, the losses scaled by nbfsdp "
        "(GradScaler's dynamic scale, no code in the cell); --precision bf16 to override"
    )
    assert "fp16 parameters (the compute), gradients reduced in fp32" in on_t4.why["mixed_precision"]
    on_a100 = validate(FSDPConfig(), 2, choose("cuda", 2, 2, capability=A100))
    assert (on_a100.precision, on_a100.dtypes()[0]) == ("bf16", torch.bfloat16) and "precision" not in on_a100.why
    asked = validate(FSDPConfig(precision="bf16"), 2, on_gpus(2, 2, capability=T4))  # asked for: as asked
    assert asked.precision == "bf16" and "precision" not in asked.why
    full = validate(FSDPConfig(mixed_precision="FULL"), 2, on_gpus(2, 2, capability=T4))  # no low precision used
    assert full.precision == "fp16" and "precision" not in full.why


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's GPUs decide its plans, not a name")
def test_a_plan_for_a_named_t4_computes_in_fp16_and_its_code_says_how_a_script_scales():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    t4 = nbfsdp.explain(model, world_size=2, device="cuda", gpu="T4")
    assert t4.dtypes["param_dtype"] == "float16" and "compute capability 7.5" in t4.config["why"]["precision"]
    assert "# scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()" in t4.code
    h100 = nbfsdp.explain(model, world_size=2, device="cuda", gpu="H100")
    assert h100.dtypes["param_dtype"] == "bfloat16" and "GradScaler" not in h100.code


def test_fp16_is_chosen_on_the_cpu_too_and_an_attached_clusters_oldest_gpu_decides():
    on_cpu = validate(FSDPConfig(precision="fp16"), 2, Devices("cpu", 2))  # no longer "fp16 needs a GPU"
    assert on_cpu.dtypes() == (torch.float16, torch.float32, torch.float32)
    assert for_device(FSDPConfig(), Devices("cpu", 2)).precision == "bf16"
    engines = {
        i: HostIdentity(hostname=host, key=host, pid=i, gpus=2, capability=capability)
        for i, (host, capability) in enumerate([("a", (9, 0)), ("a", (9, 0)), ("b", T4), ("b", T4)])
    }
    assert devices(place(engines, 4), engines, None).capability == T4
    assert devices(place(engines, 2), engines, None).capability == (9, 0)  # host a alone
    assert gpu_capability() is None or torch.cuda.is_available()  # no NVIDIA driver here: unknown, not a guess


STEPS, INF_STEP, MAX_NORM = 5, 2, 0.5
#: A plain loop: two micro-batches a step, clipping, no scaler. At INF_STEP rank 1 alone makes the gradient of
#: embed's first output inf: embed.weight's row 0 and embed.bias[0], in rank 0's shards only (rows 0-7 of 16).
FP16_LOOP = """%%fsdp --world-size 2 --wrap-cls Block --device {device} {flags}
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range({steps}):
    x, y = batch_for(rank, step)
    x, y = x.to(device), y.to(device)
    inf_hook = None
    if step == {inf_step} and rank == 1:
        inf_first = lambda grad: grad.index_fill(1, torch.tensor([0], device=grad.device), float("inf"))
        inf_hook = model.embed.register_forward_hook(lambda module, args, out: [out.register_hook(inf_first)] and None)
    total = 0.0
    for half in (slice(0, 2), slice(2, 4)):
        loss = loss_fn(model(x[half]).float(), y[half]) / 2
        loss.backward()
        total += loss.item()
    if inf_hook is not None:
        inf_hook.remove()
    dtype = str(model.embed.weight.grad.dtype)
    torch.nn.utils.clip_grad_norm_(model.parameters(), {max_norm})
    before = [p.detach().to_local().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    unchanged = all(torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
    nbfsdp.log(step=step, loss=total, unchanged=unchanged)
"""


def _one_process_with_a_grad_scaler(shell, master, device: str) -> tuple[list[float], list[float]]:
    """The loop in one process on both ranks' batches: an fp16 copy computes, fp32 weights step, a GradScaler
    scales as its documentation says (unscale_ before clipping); the inf step's gradient made inf by hand. The
    losses, and the scale before each step and after the last."""
    ns = shell.user_ns
    opt = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device)
    losses, scales = [], []
    for step in range(STEPS):
        batches = [ns["batch_for"](rank, step) for rank in range(2)]
        low = copy.deepcopy(master).half()
        total = 0.0
        for half in (slice(0, 2), slice(2, 4)):
            x = torch.cat([b[0][half] for b in batches]).to(device)
            y = torch.cat([b[1][half] for b in batches]).to(device)
            loss = ns["loss_fn"](low(x.half()).float(), y) / 2
            scaler.scale(loss).backward()
            total += loss.item()
        if step == INF_STEP:
            low.embed.weight.grad[0, 0] = float("inf")
        for param, low_param in zip(master.parameters(), low.parameters(), strict=True):
            param.grad = low_param.grad.float()
        scales.append(scaler.get_scale())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(master.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(total)
    return losses, [*scales, scaler.get_scale()]


def _check_against_one_process(shell, tiny_model, device: str, flags: str) -> None:
    master = copy.deepcopy(tiny_model).to(device)
    cell = FP16_LOOP.format(device=device, flags=flags, steps=STEPS, inf_step=INF_STEP, max_norm=MAX_NORM)
    run_ok(shell, cell)
    run = nbfsdp.last_run()
    assert run.config["precision"] == "fp16" and run.config["mixed_precision"] == "DEFAULT"
    expected_losses, expected_scales = _one_process_with_a_grad_scaler(shell, master, device)
    assert run.metric("grad_scale", 0) == run.metric("grad_scale", 1) == expected_scales[:-1]
    # a step GradScaler skipped is one after which it backed off: the inf step, and any that overflowed on its own
    skipped = [after < before for before, after in zip(expected_scales[:-1], expected_scales[1:], strict=True)]
    assert skipped[INF_STEP] and not all(skipped)
    # skipped on both ranks, though at the inf step only rank 0's shards held inf; the others stepped on both
    assert run.metric("unchanged", 0) == run.metric("unchanged", 1) == skipped
    measured = [(a + b) / 2 for a, b in zip(run.metric("loss", 0), run.metric("loss", 1), strict=True)]
    torch.testing.assert_close(torch.tensor(measured), torch.tensor(expected_losses), rtol=2e-2, atol=1e-3)
    trained = shell.user_ns["model"].state_dict()  # gathered back; fp16's rounding apart, the same weights
    for key, value in master.state_dict().items():
        torch.testing.assert_close(trained[key].float().cpu(), value.float().cpu(), rtol=2e-2, atol=2e-3)


def test_a_plain_loop_on_cpu_ranks_trains_in_fp16_as_one_process_with_a_grad_scaler(shell, tiny_model):
    _check_against_one_process(shell, tiny_model, "cpu", "--precision fp16")
    assert shell.user_ns["dtype"] == "torch.float32"  # fp32 sharded gradients of fp32 weights, unscaled in place


def test_a_loops_own_grad_scaler_is_refused_in_one_line_and_welcome_without_fp16(shell, tiny_model):
    own_scaler = """%%fsdp --world-size 2 {flags}
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
x, y = batch_for(rank, 0)
scaler.scale(loss_fn(model(x).float(), y)).backward()
scaler.step(opt)
scaler.update()
"""
    error, _ = run_failing(shell, own_scaler.format(flags="--precision fp16"))
    assert TWICE in str(error) and "\n" not in TWICE
    run_ok(shell, own_scaler.format(flags="--mixed-precision FULL"))  # fp32: its scaler is its own business
    assert "grad_scale" not in str(nbfsdp.last_run().metrics)


def test_a_model_stored_in_fp16_computes_as_stored_and_is_scaled_too(shell, tiny_model):
    """FULL keeps each parameter as stored: an fp16 model's gradients are fp16, which GradScaler.unscale_ refuses
    ("Attempting to unscale FP16 gradients"); nbfsdp unscales them all the same."""
    shell.user_ns["model"] = tiny_model.half()
    cell = """%%fsdp --world-size 2 --mixed-precision FULL
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(3):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x.half()).float(), y)
    loss.backward()
    dtype = str(model.embed.weight.grad.dtype)
    opt.step()
    opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
"""
    run_ok(shell, cell)
    run = nbfsdp.last_run()
    assert shell.user_ns["dtype"] == "torch.float16" and run.metric("grad_scale", 0)[0] == 2.0**16
    assert all(torch.isfinite(torch.tensor(run.metric("loss", rank))).all() for rank in (0, 1))
    assert all(torch.isfinite(value).all() for value in shell.user_ns["model"].state_dict().values())


@gpu
def test_a_plain_loop_on_a_gpu_trains_in_fp16_as_one_process_with_a_grad_scaler(shell, tiny_model):
    assert gpu_capability() == min(
        torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())
    )  # NVML's figure, read without a CUDA context, is torch's
    _check_against_one_process(shell, tiny_model, "cuda", "--precision fp16")


@gpu
def test_the_default_precision_here_follows_this_gpus_capability(shell, tiny_model):
    run_ok(shell, "%%fsdp --world-size 1 --device cuda\nx, y = batch_for(rank, 0)\n")
    expected = low_precision_for(torch.cuda.get_device_capability(0))
    assert nbfsdp.last_run().config["precision"] == expected
