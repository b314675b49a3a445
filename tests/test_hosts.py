"""Which host each engine is on, and ranks given host by host (issue 29, point 2).

The placement rule on its own, then real engines: ipyparallel's own SSH launcher starts two engines on
each of two "hosts" (network namespaces with an sshd each, ``benchmarks/namespaces.py``), and each engine says
which host it is on. Two namespaces with the same hostname still count as two hosts.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from benchmarks import namespaces as namespace_hosts
from nbfsdp.engines import hosts as engine_hosts
from nbfsdp.engines import release
from nbfsdp.kernel.cluster.hosts import devices, place
from nbfsdp.kernel.cluster.lifelines import Lifelines
from nbfsdp.shared.config import ConfigError
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.network import loopback_interface
from nbfsdp.shared.protocol import HostIdentity


def _engine(hostname: str, key: str | None = None, pid: int = 1, gpus: int = 0) -> HostIdentity:
    return HostIdentity(hostname=hostname, key=key or hostname, pid=pid, gpus=gpus)


def test_ranks_go_host_by_host_whatever_order_the_engines_registered_in():
    engines = {0: _engine("a"), 1: _engine("b"), 2: _engine("a"), 3: _engine("b"), 4: _engine("c")}
    placed = place(engines, 5)
    assert [(p.rank, p.engine_id, p.host, p.local_rank, p.local_world_size) for p in placed] == [
        (0, 0, "a", 0, 2), (1, 2, "a", 1, 2), (2, 1, "b", 0, 2), (3, 3, "b", 1, 2), (4, 4, "c", 0, 1),
    ]  # fmt: skip
    assert [p.group_rank for p in placed] == [0, 0, 1, 1, 2]  # torchrun's node rank: the host's place
    assert placed[3].environment(5, 3, ("10.0.0.1", 29500), "run") == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3", "ROLE_NAME": "default", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "5",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "run",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    }  # fmt: skip


def test_a_subset_fills_hosts_one_after_another():
    engines = {i: _engine("a" if i < 4 else "b") for i in range(8)}
    assert [(p.engine_id, p.host, p.local_world_size) for p in place(engines, 6)] == [
        (0, "a", 4), (1, "a", 4), (2, "a", 4), (3, "a", 4), (4, "b", 2), (5, "b", 2),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="9 ranks asked for, 8 engines"):
        place(engines, 9)


def test_hosts_that_share_a_hostname_are_told_apart_by_name_too():
    engines = {0: _engine("node", "k1"), 1: _engine("node", "k2"), 2: _engine("node", "k1")}
    assert [(p.engine_id, p.host) for p in place(engines, 3)] == [(0, "node"), (2, "node"), (1, "node#2")]


def test_every_rank_takes_a_gpu_of_its_host_or_none_does_and_hosts_short_of_gpus_are_named():
    def device(gpus_a: int, gpus_b: int, world_size: int = 4, requested: str | None = None) -> Devices:
        """Two engines on host a and two on host b, each engine seeing its host's GPUs."""
        engines = {i: _engine("a" if i < 2 else "b", gpus=gpus_a if i < 2 else gpus_b) for i in range(4)}
        return devices(place(engines, world_size), engines, requested)

    assert device(2, 2) == Devices("cuda", 4, 4, rank_gpus=(0, 1, 0, 1))
    assert device(0, 0) == Devices("cpu", 4)
    assert device(8, 0, world_size=2) == Devices("cuda", 2, 2, rank_gpus=(0, 1))  # the ranks fill host a only
    with pytest.raises(ConfigError, match=r"GPU of its own, or none has one: b has 2 ranks and 1 GPU$"):
        device(2, 1)
    with pytest.raises(ConfigError, match=r"none has one: b has 2 ranks and 0 GPUs$"):
        device(4, 0)
    assert device(2, 2, requested="cpu") == Devices("cpu", 4)


def test_device_cuda_shares_a_hosts_gpus_among_its_ranks_each_gpu_an_nccl_host_of_its_own():
    engines = {i: _engine("a" if i < 2 else "b", gpus=2 if i < 2 else 1) for i in range(4)}
    chosen = devices(place(engines, 4), engines, "cuda")
    assert (chosen.type, chosen.gpus, chosen.rank_gpus) == ("cuda", 3, (0, 1, 0, 0))
    # host b's two ranks share its GPU: NCCL must see them on different hosts; a's ranks keep one host
    assert chosen.nccl_hosts == ("a-0", "a-0", "b-0", "b-1") and str(chosen) == "4 ranks on 3 GPUs (shared)"
    without = {i: _engine("a" if i < 2 else "b", gpus=2 if i < 2 else 0) for i in range(4)}
    with pytest.raises(ConfigError, match=r"^--device cuda: b has 2 ranks and 0 GPUs$"):
        devices(place(without, 4), without, "cuda")


def test_ranks_a_launcher_bound_to_gpus_of_their_own_take_the_one_they_see():
    """Slurm's ``--gpus-per-task 1`` (or ``--gpu-bind single:1``) gives each task of a node its own GPU: the engine
    sees one (``CUDA_VISIBLE_DEVICES`` 0 or 1), takes it as its device 0, and the host is not short of GPUs; where
    every task sees the node's GPUs (``--gpus-per-node``: ``0,1`` each) ranks take ``LOCAL_RANK``'s, as before;
    tasks whose lists meet share, as any host's do."""

    def device(visible: list[str], gpus: int, requested: str | None = None) -> Devices:
        engines = {
            i: HostIdentity(hostname=h, key=h, pid=i, gpus=gpus, visible_gpus=visible[i % 2])
            for i, h in enumerate(["a", "a", "b", "b"])
        }
        return devices(place(engines, 4), engines, requested)

    assert device(["0", "1"], 1) == Devices("cuda", 4, 4, rank_gpus=(0, 0, 0, 0))
    assert device(["0,1", "0,1"], 2) == Devices("cuda", 4, 4, rank_gpus=(0, 1, 0, 1))
    with pytest.raises(ConfigError, match=r"GPU of its own, or none has one: a has 2 ranks and 1 GPU"):
        device(["0", "0"], 1)
    shared = device(["0", "0"], 1, requested="cuda")
    assert shared.rank_gpus == (0, 0, 0, 0) and shared.nccl_hosts == ("a-0", "a-1", "b-0", "b-1")


def test_the_environment_names_the_host_outright(monkeypatch):
    monkeypatch.setenv(engine_hosts.HOST_ID_VARIABLE, "rack3-node7")
    assert engine_hosts.identity().key == "rack3-node7"
    monkeypatch.delenv(engine_hosts.HOST_ID_VARIABLE)
    mine = engine_hosts.identity()
    assert mine.key.startswith(mine.hostname + "|") and "net:[" in mine.key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engines_the_ssh_launcher_started_on_two_hosts_say_which_host_they_are_on(tmp_path):
    why = namespace_hosts.why_not()
    if why:
        pytest.skip(why)
    # the same hostname on both: only the network namespace tells them apart, as with containers
    with (
        namespace_hosts.hosts(2, tmp_path, hostname="node") as machines,
        namespace_hosts.ssh_cluster(machines, 2, sys.executable) as cluster,
    ):
        client = cluster.connect_client_sync()
        found = dict(zip(client.ids, client[:].apply_sync(engine_hosts.identity), strict=True))
        client.close()
    assert {identity.hostname for identity in found.values()} == {"node"}
    assert len({identity.key for identity in found.values()}) == 2
    placed = place(found, 4)
    assert [p.host for p in placed] == ["node", "node", "node#2", "node#2"]
    for first, second in (placed[:2], placed[2:]):
        assert found[first.engine_id].key == found[second.engine_id].key
    assert found[placed[0].engine_id].key != found[placed[2].engine_id].key


def _rank_whose_peer_vanishes(rank: int, kernel: tuple[str, int], secret: str, directory: str, said: Any) -> None:
    """A rank of a world of 3 with a lifeline to ``kernel``: all-reduces until released, then joins a world of
    the 2 left (both over real gloo on loopback)."""
    os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface() or "lo"
    release.hold_lifeline(kernel, secret, rank)
    release.world_begins(7)
    wait = datetime.timedelta(seconds=120)
    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{directory}/first", 3), rank=rank, world_size=3, timeout=wait
    )
    dist.all_reduce(torch.ones(1))
    said.put((rank, "running", 0.0))
    try:
        while True:
            dist.all_reduce(torch.ones(1))
    except RuntimeError:
        said.put((rank, "released", time.monotonic()))
        dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(f"{directory}/next", 2), rank=rank, world_size=2, timeout=wait)
    total = torch.ones(1)
    dist.all_reduce(total)
    said.put((rank, f"next world {total.item()}", 0.0))
    dist.destroy_process_group()


@pytest.mark.faults
@pytest.mark.floor
def test_ranks_waiting_on_a_vanished_peer_are_released_by_the_kernels_word(tmp_path):
    """A peer stopped mid all-reduce (a host gone without closing its connections) leaves the others waiting
    until the timeout (120 s here); the kernel's ``release`` on their lifelines ends the wait at once, for
    the world it names only, and the ranks then form a new world."""
    lifelines = Lifelines("127.0.0.1")
    context = multiprocessing.get_context("spawn")
    # a queue a rank: a rank stopped while its queue's feeder held the queue's write lock would block the others'
    said = [context.Queue() for _ in range(3)]
    ranks = [
        context.Process(
            target=_rank_whose_peer_vanishes, args=(r, lifelines.address, lifelines.secret, str(tmp_path), said[r])
        )
        for r in range(3)
    ]
    for process in ranks:
        process.start()
    try:
        assert [said[r].get(timeout=60)[0] for r in range(3)] == [0, 1, 2]
        os.kill(ranks[2].pid, signal.SIGSTOP)  # its connections stay open: no peer hears it end
        time.sleep(0.5)
        lifelines.release([0, 1], 6)  # an older world's word: this one goes on waiting
        time.sleep(1.0)
        assert said[0].empty() and said[1].empty()
        asked = time.monotonic()
        lifelines.release([0, 1], 7)
        released = [said[r].get(timeout=30) for r in (0, 1)]  # a hang guard: released in milliseconds, measured
        assert [rank for rank, _, _ in released] == [0, 1] and {w for _, w, _ in released} == {"released"}
        print(f"released {max(at for _, _, at in released) - asked:.3f} s after the kernel's word")
        assert [said[r].get(timeout=60)[1] for r in (0, 1)] == ["next world 2.0"] * 2
    finally:
        os.kill(ranks[2].pid, signal.SIGKILL)
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
        lifelines.close()
