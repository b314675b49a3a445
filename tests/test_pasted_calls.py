"""``engines.pasted``: a pasted script's ``init_process_group`` and ``destroy_process_group`` replaced once per
process at a world's set-up, acting only while a cell runs. In-process, with ``dist``'s own two functions
stood in for (no world is started)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from nbfsdp.engines import pasted


@pytest.fixture
def installed(monkeypatch):
    """``pasted.install`` over recording stand-ins of ``dist``'s functions; everything put back after."""
    called: list[tuple[str, tuple, dict]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: called.append(("init", a, k)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: called.append(("destroy", (group,), {})))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(pasted, "_world", pasted._WorldCalls())
    pasted.install(0, torch.device("cpu"))
    return called


def test_the_calls_are_replaced_once_per_process_not_per_cell(installed):
    replaced = dist.init_process_group, dist.destroy_process_group
    pasted.install(1, torch.device("cpu"))  # the next world
    for filename in ("<fsdp-cell-1>", "<fsdp-cell-2>"):
        with pasted.cell_calls(filename):
            assert (dist.init_process_group, dist.destroy_process_group) == replaced
            assert sys.argv == [filename]
    assert (dist.init_process_group, dist.destroy_process_group) == replaced
    assert sys.argv != ["<fsdp-cell-2>"]


def test_outside_a_cell_they_are_the_originals(installed):
    """The engine's own set-up and teardown call them between cells."""
    dist.init_process_group("gloo", store=None, rank=0, world_size=2)
    dist.destroy_process_group()
    assert installed == [("init", ("gloo",), {"store": None, "rank": 0, "world_size": 2}), ("destroy", (None,), {})]


def test_in_a_cell_the_script_runs_in_the_world_and_a_mismatch_is_named(installed, capsys):
    with pasted.cell_calls("<fsdp-cell-1>"):
        dist.init_process_group("gloo")
        dist.init_process_group(backend="cpu:gloo", world_size=2)
        dist.destroy_process_group()
        with pytest.raises(pasted.WorldMismatch, match="world_size=4"):
            dist.init_process_group("gloo", world_size=4)
    assert installed == []  # neither reached torch
    said = capsys.readouterr().out.splitlines()
    assert said == [
        "nbfsdp: init_process_group: the cell runs in the world already started (gloo, 2 ranks)",
        "nbfsdp: destroy_process_group: the world is kept for the next cell",
    ]  # each once a cell, on rank 0
