"""A cell asks its cluster once where its world runs (``Cluster.plan_world``) and carries that ``WorldPlan``
through its steps: each ask decides the devices again, and on an attached cluster places its engines again."""

from __future__ import annotations

import pytest
import torch.nn as nn

import nbfsdp
from tests.conftest import forget_after_each_test, run_ok

pytestmark = pytest.mark.timeout(120)

forget = forget_after_each_test("planned")


def test_a_warm_cell_asks_its_cluster_once_where_its_world_runs(shell, monkeypatch):
    cluster = nbfsdp._magics.session.cluster
    shell.user_ns["planned"] = nn.Linear(4, 4)
    cell = "%%fsdp --world-size 2 --device cpu\nout = planned.weight.sum().item()"
    run_ok(shell, cell)
    world = cluster.world
    asked: list[tuple] = []
    real = cluster.devices

    def counted(*args, **kwargs):
        asked.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(cluster, "devices", counted)
    run_ok(shell, cell)
    assert cluster.world is world  # warm: the same world ran it
    assert asked == [(2, "cpu")]  # before the plan: 4 asks (twice "does it reuse the world?", then 2 more)
