"""The kernel/engine messages (``nbfsdp.shared.protocol``) as each side writes and reads them.

The request file goes through the real writer (the kernel's ``RunControl``) and the real readers (the
ranks' ``RankControl``) on disk; the cell's objects through cloudpickle, as ipyparallel sends them.
Whole cells over a cluster are in test_runtime, test_live, test_faults and test_progress.
"""

from __future__ import annotations

import cloudpickle
import pytest
import torch

from nbfsdp.engines.control import CellCancelled, RankControl
from nbfsdp.kernel.run.control import RunControl
from nbfsdp.shared.config import FSDPConfig
from nbfsdp.shared.protocol import (
    BAR_MARKER,
    Arrival,
    BarDrawing,
    CellOutcome,
    CellSpec,
    ControlRequest,
    LoaderSplit,
    ModelRoute,
    Returns,
    claim_file,
    control_file,
)


def test_a_control_request_round_trips_through_json():
    request = ControlRequest(version=3, settings={"forward_prefetch": True, "mixed_precision": "PURE"}, cancel=True)
    assert ControlRequest.from_json(request.to_json()) == request
    assert ControlRequest.from_json(ControlRequest().to_json()) == ControlRequest(version=0, settings={}, cancel=False)


def test_ranks_read_the_kernels_requests_and_apply_each_at_one_boundary(tmp_path):
    run = RunControl(str(tmp_path), 1)
    assert run.path == control_file(tmp_path, 1)
    applied: dict[str, list[tuple[int, dict]]] = {"a": [], "b": []}

    def rank(name: str) -> RankControl:
        def apply(settings: dict) -> list[str]:
            applied[name].append((boundary, dict(settings)))
            return [f"{key}={value}" for key, value in settings.items()]

        return RankControl(str(run.path), apply)

    a, b = rank("a"), rank("b")
    boundary = 0
    assert a.at_boundary(0) == [] and b.at_boundary(0) == []  # version 0: nothing asked yet

    run.change({"forward_prefetch": True})
    boundary = 3
    assert a.at_boundary(3) == []  # a sees version 1 first and claims boundary 4 for it
    assert claim_file(run.path, 1).read_text() == "4"
    boundary = 4
    assert b.at_boundary(4) == ["forward_prefetch=True"]  # b sees it late, at the claimed boundary itself
    assert a.at_boundary(4) == ["forward_prefetch=True"]
    assert applied == {"a": [(4, {"forward_prefetch": True})], "b": [(4, {"forward_prefetch": True})]}

    run.cancel()
    boundary = 7
    assert a.at_boundary(7) == [] and b.at_boundary(7) == []
    boundary = 8
    for control in (a, b):
        with pytest.raises(CellCancelled):
            control.at_boundary(8)
    assert applied["a"][-1] == (8, {"forward_prefetch": True})  # the settings so far, then the cancel


def test_removing_a_run_leaves_another_runs_files(tmp_path):
    first, tenth = RunControl(str(tmp_path), 1), RunControl(str(tmp_path), 10)
    for run in (first, tenth):
        run.change({"forward_prefetch": True})
        RankControl(str(run.path), lambda settings: []).at_boundary(0)  # leaves a claim file
    first.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["control-10-v1.claim", "control-10.json"]
    tenth.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_outcome_has_the_failed_shape():
    failed = CellOutcome(ok=False, error="RuntimeError: boom", traceback="tb", secondary=True, metrics=[{"step": 1}])
    assert (failed.ok, failed.error, failed.traceback, failed.secondary, failed.engine_lost) == (
        False,
        "RuntimeError: boom",
        "tb",
        True,
        False,
    )
    assert failed.metrics == [{"step": 1}]
    assert not (failed.names or failed.states or failed.settings or failed.in_place or failed.loaders)
    assert CellOutcome.failed("engine died").metrics == []


def test_the_messages_travel_by_reference_and_round_trip():
    """cloudpickle, as ipyparallel sends them: the classes by name (engines import this module), the fields by value."""
    route = ModelRoute(token=5, arrives=Arrival.DELIVERED, returns=Returns.CHANGED)
    spec = CellSpec(
        code="x = 1",
        filename="<fsdp-cell-1>",
        generation=2,
        models={"model": route},
        assigned=["x"],
        fsdp=FSDPConfig(sharding_strategy="SHARD_GRAD_OP", wrap_cls=("Block",)),
        seed=7,
        control="/tmp/control-1.json",
        loaders={"train": LoaderSplit(per_rank=True, seed_state=torch.Generator().manual_seed(3).get_state())},
    )
    data = cloudpickle.dumps(spec)
    assert b"nbfsdp.shared.protocol" in data and b"code" in data
    back = cloudpickle.loads(data)
    assert back.fsdp == spec.fsdp and back.models == {"model": route}
    assert back.models["model"].arrives is Arrival.DELIVERED  # the enum itself, by reference: `is` holds on a rank
    assert torch.equal(back.loaders["train"].seed_state, spec.loaders["train"].seed_state)
    outcome = CellOutcome(ok=True, cancelled=True, names={"x": b"1"}, settings={"model": spec.fsdp})
    assert cloudpickle.loads(cloudpickle.dumps(outcome)) == outcome


def test_a_bar_drawing_is_one_marked_line():
    drawing = BarDrawing(bar="3", ended=True, text="train: 100%|##########| 20/20\nsecond line")
    line = drawing.line()
    assert line.startswith(BAR_MARKER) and line.endswith("\n") and line.count("\n") == 1
    before, marker, drawn = line.rstrip("\n").partition(BAR_MARKER)
    assert before == "" and marker == BAR_MARKER
    assert BarDrawing.parse(drawn) == BarDrawing(bar="3", ended=True, text="train: 100%|##########| 20/20 second line")
    assert BarDrawing.parse(BarDrawing(bar="0", ended=False, text="").line().rstrip("\n")[len(BAR_MARKER) :]) == (
        BarDrawing(bar="0", ended=False, text="")
    )
    assert BarDrawing.parse("3 maybe text") is None and BarDrawing.parse("3") is None
