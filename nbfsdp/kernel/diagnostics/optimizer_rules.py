"""The check's optimizer rules: an optimizer over parameters the cell does not shard (the notebook's, or one the
cell builds before the model is sharded) would step what the ranks never train."""

from __future__ import annotations

import ast
from typing import Any

import torch.nn as nn
from torch.optim import Optimizer

from nbfsdp.kernel.diagnostics.cell_code import CellCode, dotted, statement_text
from nbfsdp.kernel.diagnostics.findings import Finding
from nbfsdp.shared import transfer

_UNSHARDED = (
    "nbfsdp shards only the models a cell reads, and an optimizer must hold their sharded parameters: these go "
    "to each rank as a plain copy, so the steps change that copy and the model the cell trains is never stepped"
)


def findings(cell: CellCode, models: dict[str, nn.Module]) -> list[Finding]:
    reads, _ = transfer.analyze_cell(cell.tree)
    sharded = {id(p) for model in models.values() for p in model.parameters()}
    findings = []
    for name in reads:
        optimizer = cell.namespace.get(name)
        if not isinstance(optimizer, Optimizer):
            continue
        params = [p for group in optimizer.param_groups for p in group["params"]]
        outside = [p for p in params if id(p) not in sharded]
        if outside:
            findings.append(_optimizer_finding(cell, name, optimizer, params, outside, models))
    return findings + _cell_built_optimizers(cell)


def _optimizer_finding(
    cell: CellCode, name: str, optimizer: Optimizer, params: list, outside: list, models: dict[str, nn.Module]
) -> Finding:
    owner = _owner(cell.namespace, {id(p) for p in outside})
    if owner is not None:
        whose = f"they are {owner}'s parameters, and the cell does not read {owner}"
    else:
        whose = "they are no notebook model's (an earlier model's? re-running the cell that builds a model makes new "
        whose += "parameters: build the optimizer after it)"
    target = next(iter(models), owner or "model")
    line = cell.first_use(name)
    cls = type(optimizer)
    made = f"torch.optim.{cls.__name__}" if cls.__module__.startswith("torch.optim") else cls.__name__
    return Finding(
        kind="optimizer",
        line=line,
        text=cell.line(line),
        what=f"{name} holds {len(outside)} of its {len(params)} parameters outside the models this cell shards: "
        f"{whose}",
        why=_UNSHARDED,
        fix=f"{name} = {made}({target}.parameters(), lr={optimizer.defaults.get('lr')!r})  # at the cell's top",
    )


def _owner(namespace: dict[str, Any], ids: set[int]) -> str | None:
    for name, value in namespace.items():
        if not name.startswith("_") and isinstance(value, nn.Module) and any(id(p) in ids for p in value.parameters()):
            return name
    return None


def _cell_built_optimizers(cell: CellCode) -> list[Finding]:
    """An optimizer the cell builds over a module the cell builds and does not shard."""
    built = {
        t.id: node
        for node in cell.tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    findings = []
    for node in ast.walk(cell.tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and node.value.args):
            continue
        targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        if not (set(targets) & cell.optimizers):
            continue
        for call in (n for n in ast.walk(node.value.args[0]) if isinstance(n, ast.Call)):
            module = dotted(call.func).rpartition(".")[0]
            if dotted(call.func).endswith("parameters") and module in built and module not in cell.models:
                made = statement_text(cell.source, built[module])
                findings.append(
                    Finding(
                        kind="optimizer",
                        line=node.lineno,
                        text=cell.line(node.lineno),
                        what=f"{targets[0]} is built over {module}'s parameters, and {module} is made in this cell "
                        f"(line {built[module].lineno}): nbfsdp shards only the notebook's models, so nothing "
                        "shards it",
                        why=f"each rank trains its own copy of {module} on its own batches, its gradients never "
                        "averaged across the ranks: the copies drift apart",
                        fix=f"{made}\nfully_shard({module})  # from torch.distributed.fsdp import fully_shard",
                    )
                )
    return findings
