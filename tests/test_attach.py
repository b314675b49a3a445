"""``%fsdp attach`` to a cluster nbfsdp did not start, over two hosts (issue 29, points 1-3).

The hosts are network namespaces with an sshd each (``tests/hosts.py``); ipyparallel's own SSH launcher
starts two engines on each, the controller on the bridge. The notebook attaches by profile name, trains
at world size 4 (the same math as one process on the same global batch), sees each rank's host, and
detaches, leaving the cluster running; ``%fsdp stop`` refuses to stop it.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from IPython.core.error import UsageError

import nbfsdp
from tests import hosts as namespace_hosts
from tests.conftest import one_process_losses, run_failing, run_ok

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS = 4
TRAIN = f"""%%fsdp --mixed-precision FULL --wrap-cls Block
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
import os, socket
for step in range({STEPS}):
    x, y = batch_for(rank, step)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward(); opt.step(); opt.zero_grad()
    nbfsdp.log(step=step, loss=loss.item())
where = [None] * world_size
here = (socket.gethostname(), os.environ["LOCAL_RANK"], os.environ["GLOO_SOCKET_IFNAME"])
torch.distributed.all_gather_object(where, here)
"""
#: Which ranks each rank's shard and replicate groups hold (HYBRID_SHARD's mesh).
MESH = """
mesh = next(model.parameters()).device_mesh
mine = tuple(torch.distributed.get_process_group_ranks(mesh.get_group(d)) for d in ("shard", "replicate"))
groups = [None] * world_size
torch.distributed.all_gather_object(groups, mine)
"""


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """2 hosts x 2 engines, started by ipyparallel's SSH launcher, in profile "gpus" of a fresh IPYTHONDIR."""
    why = namespace_hosts.why_not()
    if why:
        pytest.skip(why)
    directory = tmp_path_factory.mktemp("hosts")
    before = os.environ.get("IPYTHONDIR")
    os.environ["IPYTHONDIR"] = str(directory / "ipython")
    try:
        with (
            namespace_hosts.hosts(2, directory / "hosts") as machines,
            namespace_hosts.ssh_cluster(machines, 2, sys.executable, profile="gpus") as cluster,
        ):
            yield machines, cluster
    finally:
        if before is None:
            os.environ.pop("IPYTHONDIR", None)
        else:
            os.environ["IPYTHONDIR"] = before


def _assert_same_math(shell, tiny_model, reference, world_size: int) -> None:
    run = nbfsdp.last_run()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = one_process_losses(shell, reference, opt, world_size, STEPS)
    sharded = [sum(run.metric("loss", rank=r)[step] for r in range(world_size)) / world_size for step in range(STEPS)]
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(expected))
    for (name, trained), (_, wanted) in zip(tiny_model.named_parameters(), reference.named_parameters(), strict=True):
        torch.testing.assert_close(trained, wanted, msg=lambda m, name=name: f"{name}: {m}")


def test_attach_to_two_hosts_train_as_one_process_and_detach(shell, tiny_model, two_hosts, capsys):
    machines, cluster = two_hosts
    reference = copy.deepcopy(tiny_model)
    run_ok(shell, "%fsdp attach --profile gpus")
    assert "attached to 4 engines" in capsys.readouterr().out
    run_ok(shell, TRAIN)  # no --world-size: every engine of the attached cluster
    assert nbfsdp.last_run().ok and nbfsdp.last_run().world_size == 4
    names = [h.name for h in machines.hosts]
    assert shell.user_ns["where"] == [
        (names[0], "0", "eth0"),
        (names[0], "1", "eth0"),
        (names[1], "0", "eth0"),
        (names[1], "1", "eth0"),
    ]
    run_ok(shell, "%fsdp status")
    status = capsys.readouterr().out
    assert all(name in status for name in names), status

    # on rank 0's host, nothing listens beyond its own address on the hosts' network and loopback:
    # the world's store and gloo are bound to the address toward the others, never to every interface
    listening = subprocess.run(
        ["ip", "netns", "exec", names[0], "ss", "-ltnH"], capture_output=True, text=True, check=True
    ).stdout
    local = {line.split()[3].rsplit(":", 1)[0] for line in listening.splitlines()}
    assert local <= {"127.0.0.1", machines.hosts[0].address}, listening

    error, _ = run_failing(shell, "%fsdp stop")
    assert isinstance(error, UsageError) and "did not start this cluster" in str(error)
    run_ok(shell, "%fsdp detach")
    assert "the cluster goes on running" in capsys.readouterr().out
    client = cluster.connect_client_sync()
    assert len(client.ids) == 4  # still running
    client.close()
    _assert_same_math(shell, tiny_model, reference, 4)


def test_hybrid_shard_shards_inside_each_host_and_replicates_across(shell, tiny_model, two_hosts):
    reference = copy.deepcopy(tiny_model)
    run_ok(shell, "%fsdp attach --profile gpus")
    error, _ = run_failing(shell, "%%fsdp --world-size 3 --sharding-strategy HYBRID_SHARD\nx = 1")
    assert isinstance(error, UsageError) and "as many ranks on every host" in str(error), error
    assert all(f"{h.name} {n}" in str(error) for h, n in zip(two_hosts[0].hosts, (2, 1), strict=True)), error
    run_ok(shell, TRAIN.replace("%%fsdp", "%%fsdp --sharding-strategy HYBRID_SHARD") + MESH)
    run = nbfsdp.last_run()
    assert run.config["replicas"] == 2 and "one replica per host" in run.config["why"]["replicas"]
    hosts_of = [host for host, _, _ in shell.user_ns["where"]]
    for rank, (shard, replicate) in enumerate(shell.user_ns["groups"]):
        assert {hosts_of[r] for r in shard} == {hosts_of[rank]} and len(shard) == 2  # inside its host
        assert len({hosts_of[r] for r in replicate}) == 2  # one rank of each host
    run_ok(shell, "%fsdp detach")
    _assert_same_math(shell, tiny_model, reference, 4)
