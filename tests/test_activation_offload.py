"""``--activation-cpu-offload`` on the engines (``engines.sharding.HostOffload``): what a module saves for
backward goes through ``save_on_cpu``, but for the unit's gathered parameters, which FSDP gathers again.

Run in a fresh process with a one-rank gloo world (FSDP2 on real units), so that the process group stays out of
the test process."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import copy, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from nbfsdp.engines.sharding import HostOffload

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
plain = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
model = copy.deepcopy(plain)
offload = HostOffload(model, pin_memory=False)
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
x = torch.randn(2, 256)
model(x).square().sum().backward()
plain(x).square().sum().backward()
same = all(torch.equal(p.grad.full_tensor(), q.grad) for p, q in zip(model.parameters(), plain.parameters()))
print(json.dumps({"moved": offload.moved, "activations": 3 * x.nbytes, "weights": 2 * 256 * 256 * 4, "same": same}))
dist.destroy_process_group()
"""


def test_offload_moves_the_activations_and_leaves_the_gathered_weights_for_fsdp():
    """Two Linears and a tanh on a batch of 2: the activations (the input, and the tanh's output, saved twice: by
    the tanh and by the second Linear) are what goes to the host, not the 512 KiB of weights the matmuls save;
    the gradients are those of the model without it."""
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["same"]
    assert seen["moved"] == seen["activations"], seen  # save_on_cpu alone would add the weights
    assert seen["moved"] < seen["weights"] / 50
