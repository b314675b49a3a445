"""One record per model through a cell's journey: its route on the wire (``ModelRoute``), what comes back decided in
one place (``spec.returns_of``), and a model living on the ranks changed only through its record's own methods.

The layout checks read the source with ``ast``; the behaviour ones use plain modules and the kernel's functions:
what reaches the ranks is held by the suite's cells over real clusters (test_pretrained, test_lora, test_gather).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from nbfsdp.kernel.run import cell_run, residence, spec
from nbfsdp.kernel.run.spec import ADAPTER_SHARE, CellModel, Delivery, PreparedCell, returns_of
from nbfsdp.shared.protocol import Arrival, CellSpec, GatherModel, LoadCheckpoint, ModelRoute, Returns
from nbfsdp.ui.dashboard import LiveDashboard

PACKAGE = Path(__file__).resolve().parents[1] / "nbfsdp"


#: What held something of each model by name beside ``models`` before the route: parallel lists and maps.
PARALLEL = {"model_tokens", "tokens", "gather", "materialize", "sources", "on_ranks", "trained_back", "skeletons"}


def test_a_cell_carries_one_route_per_model_from_the_kernel_to_the_ranks():
    """``CellSpec.models`` maps each model to its route; no parallel list or map by model name is left beside it, in
    the spec, the prepared cell or the delivery."""
    assert typing.get_type_hints(CellSpec)["models"] == dict[str, ModelRoute]
    assert typing.get_type_hints(Delivery)["routes"] == dict[str, ModelRoute]
    assert typing.get_type_hints(PreparedCell)["models"] == dict[str, CellModel]
    for cls in (CellSpec, PreparedCell, Delivery):
        assert PARALLEL.isdisjoint({f.name for f in dataclasses.fields(cls)} - {"models"}), cls.__name__
        assert "fingerprints" not in {f.name for f in dataclasses.fields(cls)}, cls.__name__


def test_a_route_is_frozen_and_built_by_keyword():
    route = ModelRoute(token=3, arrives=Arrival.READ, returns=Returns.ADAPTERS, on_ranks=True, source="/ckpt")
    with pytest.raises(TypeError):
        ModelRoute(3, Arrival.HELD, Returns.NOTHING)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        route.token = 4  # type: ignore[misc]
    assert route.watched and ModelRoute(token=1, arrives=Arrival.HELD, returns=Returns.CHANGED).watched
    assert not ModelRoute(token=1, arrives=Arrival.HELD, returns=Returns.NOTHING).watched


def _lora_like(trainable_share: float) -> nn.Module:
    """A frozen base and one trainable adapter of about ``trainable_share`` of its bytes."""
    model = nn.Sequential(nn.Linear(100, 100, bias=False), nn.Linear(100, round(100 * trainable_share), bias=False))
    model[0].weight.requires_grad_(False)
    return model


def test_what_comes_back_of_a_model_is_decided_in_the_kernel_by_one_rule():
    plain, lora, wide = nn.Linear(4, 4), _lora_like(0.05), _lora_like(ADAPTER_SHARE * 3)
    assert returns_of("m", plain, on_ranks=False, gather=True, request=None) is Returns.CHANGED
    assert returns_of("m", plain, on_ranks=False, gather=False, request=None) is Returns.NOTHING
    assert returns_of("m", lora, on_ranks=True, gather=True, request=None) is Returns.ADAPTERS
    assert returns_of("m", wide, on_ranks=True, gather=True, request=None) is Returns.NOTHING  # trains too much
    assert returns_of("m", plain, on_ranks=True, gather=True, request=None) is Returns.NOTHING  # all of it trains
    assert returns_of("m", lora.to("meta"), on_ranks=True, gather=True, request=None) is Returns.ADAPTERS
    gather = GatherModel(model="m")
    assert returns_of("m", lora, on_ranks=True, gather=True, request=gather) is Returns.ALL
    assert returns_of("n", lora, on_ranks=True, gather=True, request=gather) is Returns.NOTHING
    load = LoadCheckpoint(directory="/x", models=["m"], optimizers={}, schedulers=[], ignore=[], restore_rng=False)
    assert returns_of("m", lora, on_ranks=True, gather=True, request=load) is Returns.NOTHING
    assert returns_of("m", plain, on_ranks=False, gather=True, request=load) is Returns.CHANGED


def _returns_decided(path: Path) -> list[str]:
    """Lines of ``path`` that produce a ``Returns`` member as a value (returned, assigned, passed): a decision.
    Comparisons and ``case`` patterns only read one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        values = []
        if isinstance(node, (ast.Return, ast.Assign, ast.AnnAssign, ast.keyword)) and node.value is not None:
            values = [node.value]
        elif isinstance(node, ast.IfExp):
            values = [node.body, node.orelse]
        for value in values:
            if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "Returns":
                found.append(f"{value.lineno}: Returns.{value.attr}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_returns_are_decided_only_by_returns_of():
    decided = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if (found := _returns_decided(path))
    }
    assert set(decided) == {"nbfsdp/kernel/run/spec.py"}, decided
    source = (PACKAGE / "kernel/run/spec.py").read_text()
    function = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "returns_of")
    lines = range(function.lineno, (function.end_lineno or 0) + 1)
    assert all(int(line.split(":")[0]) in lines for line in decided["nbfsdp/kernel/run/spec.py"])


def test_the_decision_check_sees_each_way_of_producing_one(tmp_path):
    source = tmp_path / "deciding.py"
    source.write_text(
        "def f(x):\n    if x:\n        return Returns.ALL\n    y = Returns.CHANGED\n"
        "    g(returns=Returns.NOTHING)\n    z = Returns.ADAPTERS if x else y\n"
        "    return x.returns is Returns.NOTHING\n"
    )
    assert _returns_decided(source) == [
        "3: Returns.ALL",
        "4: Returns.CHANGED",
        "5: Returns.NOTHING",
        "6: Returns.ADAPTERS",
    ]


_RECORD_FIELDS = {f.name for f in dataclasses.fields(residence.OnRanks)}


def _record_writes(path: Path) -> list[str]:
    """Assignments to a field of an ``OnRanks`` record (by name, on any receiver but ``self``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = node.targets if isinstance(node, ast.Assign) else []
        targets = [*targets, node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else targets
        for target in targets:
            for part in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, ast.Attribute) and part.attr in _RECORD_FIELDS:
                    receiver = part.value
                    if not (isinstance(receiver, ast.Name) and receiver.id == "self"):
                        found.append(f"{part.lineno}: .{part.attr}")
    return found


def test_a_model_living_on_the_ranks_changes_only_through_its_record():
    """No ``record.world = ...`` outside ``residence.py`` in the kernel (the only side that has the record): the
    record owns its transitions."""
    writes = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted((PACKAGE / "kernel").rglob("*.py"))
        if path.name != "residence.py" and (found := _record_writes(path))
    }
    assert writes == {}
    inside = _record_writes(PACKAGE / "kernel/run/residence.py")
    assert inside == []  # residence's own module functions call the record's methods too


def test_the_record_check_sees_a_write_on_any_receiver(tmp_path):
    source = tmp_path / "writing.py"
    source.write_text(
        "def f(record, r):\n    record.world = None\n    r.written, r.here = True, 3\n    r.here += 1\n"
        "    self.world = 1\n"
    )
    assert _record_writes(source) == ["2: .world", "3: .written", "3: .here", "4: .here"]


def test_a_records_transitions(capsys):
    model = _lora_like(0.05)
    record = residence.mark(model, source="/ckpt")
    assert (record.world, record.written, record.replaceable) == (None, False, True)
    record.held_by((2, 4), written=False)
    assert record.world == (2, 4) and record.replaceable
    record.read_again("llama")
    assert record.world is None and "llama: the ranks read its weights from /ckpt again" in capsys.readouterr().err
    record.held_by((3, 4), written=True)
    record.held_by((3, 4), written=False)  # a later cell that changes nothing keeps what an earlier one did
    assert record.written and not record.replaceable and "changed there by a cell" in repr(model)
    record.read_from("/other")
    assert (record.source, record.world, record.written) == ("/other", None, False)


def test_settling_after_a_cell_frees_the_notebook_copy_or_takes_the_adapters():
    """``residence.settle``: the notebook's copy goes (the ranks hold the weights), or, where adapters came back,
    the notebook holds those on a meta base and the record counts them."""
    model = _lora_like(0.05)
    assert residence.settle(model, world=(1, 2), written=True, state=None)  # freed: its skeleton changed form
    assert all(p.is_meta for p in model.parameters()) and residence.of(model).world == (1, 2)
    assert not residence.settle(model, world=(1, 2), written=False, state=None)  # already a skeleton
    adapter = torch.full((5, 100), 0.5)
    assert residence.settle(model, world=(1, 2), written=True, state={"1.weight": adapter})
    assert model[0].weight.is_meta and torch.equal(model[1].weight, adapter)
    assert residence.of(model).here == adapter.nbytes and "here too" in repr(model)


def test_the_cells_journey_is_built_by_keyword():
    """The seams a cell passes through take what they carry by keyword past their first arguments, so a call
    reads as what it passes (ruff holds the rest: ``FBT``, ``PLR0917``)."""
    seams = {
        "prepare": (spec.prepare, 2),
        "cell_spec": (spec.cell_spec, 2),
        "submit": (cell_run.submit, 2),
        "predict_peak": (cell_run.predict_peak, 2),
        "LiveDashboard": (LiveDashboard.__init__, 2),
        "CellRun": (cell_run.CellRun, 0),
        "PreparedCell": (spec.PreparedCell, 0),
    }
    positional = {
        name: [
            p.name
            for p in inspect.signature(function).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        for name, (function, _) in seams.items()
    }
    assert {name: names for name, names in positional.items() if len(names) > seams[name][1]} == {}


def test_a_cell_run_is_built_whole():
    """Only what happens to a run after it starts is set on it (its late prediction, its thread, its outcome):
    nothing the run is made of is filled in after ``CellRun(...)``."""
    later = {"prediction", "thread", "outcome"}
    made_of = {f.name for f in dataclasses.fields(cell_run.CellRun)} - later
    assigned = {
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{target.attr}"
        for path in sorted((PACKAGE / "kernel").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign)
        for target in [t for part in node.targets for t in (part.elts if isinstance(part, ast.Tuple) else [part])]
        if isinstance(target, ast.Attribute)
        and target.attr in made_of
        and not (isinstance(target.value, ast.Name) and target.value.id == "self")
    }
    assert assigned == set()
