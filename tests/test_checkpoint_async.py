"""``%fsdp save --async`` on real ranks and a real file system (issue 28, point 5).

The save returns once every rank has its snapshot; the ranks write it while the next cells train. To
hold the write at a chosen moment the ranks' DCP writer (``FileSystemWriter.write_data``, the storage
writer's public entry point) is made to wait for a file first: a slow writer, set up by a real cell on
the real ranks, so the next cell's changes and collectives certainly happen before any byte is written.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import nbfsdp
from nbfsdp.shared.checkpoints import MANIFEST, list_checkpoints
from tests.conftest import run_ok

pytestmark = [pytest.mark.slow, pytest.mark.floor]

MODEL = """
import torch, torch.nn as nn, nbfsdp
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 5))
net_opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
"""

STEP = """%%fsdp --world-size 2
net(torch.ones(4, 16) * (rank + 1)).square().mean().backward()
net_opt.step()
net_opt.zero_grad()
"""

#: On every rank: DCP's writer waits until ``release`` exists before it writes anything.
SLOW_WRITER = """%%fsdp --world-size 2
import os, time
from torch.distributed.checkpoint import FileSystemWriter
_write_data = FileSystemWriter.write_data

def _held_write(self, plan, planner):
    while not os.path.exists({release!r}):
        time.sleep(0.01)
    return _write_data(self, plan, planner)

FileSystemWriter.write_data = _held_write
"""

UNDO_SLOW_WRITER = "%%fsdp --world-size 2\nFileSystemWriter.write_data = _write_data"


def _state(shell, name: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in shell.user_ns[name].state_dict().items()}


def test_an_async_save_keeps_the_snapshot_while_the_next_cell_trains(shell, tmp_path):
    """Returns with the write held; the next cell changes every parameter and runs collectives on the
    world's group meanwhile; the file then holds the weights and optimizer state of the save, not after."""
    run_ok(shell, "%fsdp stop")
    run_ok(shell, MODEL)
    run_ok(shell, STEP)
    weights, optimizer = _state(shell, "net"), shell.user_ns["net_opt"].state_dict()
    release = tmp_path / "release"
    run_ok(shell, SLOW_WRITER.format(release=str(release)))
    path = tmp_path / "snap"
    started = time.monotonic()
    run_ok(shell, f"%fsdp save {path} --async")
    assert time.monotonic() - started < 20  # it did not wait for the held write
    assert nbfsdp._magics.session.pending_save is not None and not path.exists()
    # in place, on the very tensors the snapshot was taken of; then the write goes on while this cell
    # trains, its collectives on the world's group and the write's on its own
    run_ok(
        shell,
        "%%fsdp --world-size 2\n"
        "with torch.no_grad():\n"
        "    for p in net.parameters():\n"
        "        p.add_(1.0)\n"
        f"written_before = os.path.exists({str(path / MANIFEST)!r})\n"
        f"open({str(release)!r}, 'w').close()\n"
        "time.sleep(0.5 * rank)  # the ranks' next collectives and the write's come in different orders\n"
        "for _ in range(40):\n"
        "    net(torch.ones(4, 16)).square().mean().backward()\n"
        "    net_opt.step()\n"
        "    net_opt.zero_grad()\n",
    )
    assert shell.user_ns["written_before"] is False
    run_ok(shell, "%fsdp wait")
    assert nbfsdp._magics.session.pending_save is None and (path / MANIFEST).is_file()
    run_ok(shell, UNDO_SLOW_WRITER)

    plain = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 5))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    nbfsdp.load(path, into=plain, optimizer=plain_opt)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, weights[key], rtol=0, atol=0, msg=key)
    for index, state in plain_opt.state_dict()["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(value, optimizer["state"][index][key], rtol=0, atol=0, msg=key)
    assert not torch.equal(shell.user_ns["net"].state_dict()["0.weight"], weights["0.weight"])  # it did change


def _release_after(release, seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, release.touch)
    timer.start()
    return timer


def test_the_next_save_a_new_world_size_and_a_stop_wait_for_the_write(shell, tmp_path, capsys):
    run_ok(shell, "%fsdp stop")
    run_ok(shell, "%fsdp wait")
    assert "nothing to wait for" in capsys.readouterr().out
    run_ok(shell, MODEL)
    run_ok(shell, STEP)
    release = tmp_path / "release"
    run_ok(shell, SLOW_WRITER.format(release=str(release)))
    first, second, third, fourth = (tmp_path / name for name in ("first", "second", "third", "fourth"))
    run_ok(shell, f"%fsdp save {first} --async")
    run_ok(shell, "%fsdp status")
    assert f"saving {first} in the background" in capsys.readouterr().out
    started = time.monotonic()
    _release_after(release, 1.5)
    run_ok(shell, f"%fsdp save {second}")  # waits for the first to be complete, then saves
    assert time.monotonic() - started >= 1.5
    assert [(i.name, i.complete) for i in list_checkpoints(tmp_path)] == [("first", True), ("second", True)]

    release.unlink()
    run_ok(shell, f"%fsdp save {third} --async")
    _release_after(release, 1.0)
    run_ok(shell, "%%fsdp --world-size 3\nsize = world_size\nnet")  # a new world: the old one's write ends first
    assert shell.user_ns["size"] == 3 and (third / MANIFEST).is_file()
    assert f"saved {third}" in capsys.readouterr().out

    run_ok(shell, f"%fsdp save {fourth} --async")
    run_ok(shell, "%fsdp stop")
    assert (fourth / MANIFEST).is_file() and nbfsdp._magics.session.cluster.world is None
    assert nbfsdp.checkpoints(tmp_path)[-1].world_size == 3
