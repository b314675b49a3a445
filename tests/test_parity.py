"""Sharded training is the same math as one process on the same global batch."""

from __future__ import annotations

import copy

import pytest
import torch

import nbfsdp
from tests.conftest import run_ok

pytestmark = pytest.mark.floor

STEPS = 5

OPTIMIZERS = {
    "sgd_momentum": "torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)",
    "adamw": "torch.optim.AdamW(model.parameters(), lr=1e-2)",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fsdp_training_matches_single_process(shell, tiny_model, optimizer):
    reference = copy.deepcopy(tiny_model)
    ns = shell.user_ns

    run_ok(
        shell,
        f"""%%fsdp --world-size 2 --mixed-precision FULL --wrap-cls Block
opt = {OPTIMIZERS[optimizer]}
for step in range({STEPS}):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
""",
    )

    model = reference
    opt = eval(OPTIMIZERS[optimizer])
    expected_losses = []
    for step in range(STEPS):
        batches = [ns["batch_for"](rank, step) for rank in range(2)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loss = ns["loss_fn"](model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected_losses.append(loss.item())

    run = nbfsdp.last_run()
    # each rank's loss is the mean over its half; the global mean is their mean
    sharded_losses = [
        (run.metric("loss", rank=0)[step] + run.metric("loss", rank=1)[step]) / 2 for step in range(STEPS)
    ]
    torch.testing.assert_close(torch.tensor(sharded_losses), torch.tensor(expected_losses))
    for (name, trained), (_, expected) in zip(tiny_model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, expected, msg=lambda m, name=name: f"{name}: {m}")
