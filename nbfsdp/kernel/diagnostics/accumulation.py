"""The check's gradient-accumulation rule: micro-batches that each reduce-scatter their gradients, where
``set_requires_gradient_sync(False)`` would reduce once a step."""

from __future__ import annotations

import ast

import torch
import torch.nn as nn

from nbfsdp.kernel.diagnostics.cell_code import SYNC_SETTINGS, CellCode, dotted, own_nodes, statement_text
from nbfsdp.kernel.diagnostics.findings import Finding
from nbfsdp.kernel.planning.plans import plan
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.config import ConfigError, FSDPConfig
from nbfsdp.shared.devices import Devices

#: Gradient accumulation without ``set_requires_gradient_sync`` is a finding from this many bytes of gradients
#: reduce-scattered a micro-batch (the planner's): below it a collective's cost is its latency, not its bytes,
#: and the extra reduce-scatters are cheap.
ACCUMULATION_BYTES = 2**20


def findings(
    cell: CellCode, models: dict[str, nn.Module], config: FSDPConfig, world_size: int, devices: Devices
) -> list[Finding]:
    """A loop that backwards several times per optimizer step without ``set_requires_gradient_sync``: FSDP2
    reduce-scatters every micro-batch. Said where the planner's gradients pass ``ACCUMULATION_BYTES``."""
    if any(
        (isinstance(n, ast.Attribute) and n.attr in SYNC_SETTINGS)
        or (isinstance(n, ast.Name) and n.id in SYNC_SETTINGS)
        for n in ast.walk(cell.tree)
    ):
        return []
    parents = {id(child): node for node in ast.walk(cell.tree) for child in ast.iter_child_nodes(node)}
    for backward in (n for n in ast.walk(cell.tree) if isinstance(n, ast.Call) and dotted(n.func).endswith("backward")):
        accumulated = _accumulated(cell, backward, parents)
        if accumulated is None:
            continue
        loop, step, condition, micro = accumulated
        trained = [n for n in dict.fromkeys(c.kind.partition("'")[0] for c in cell.collectives(loop)) if n in models]
        if not trained:
            continue
        name = trained[0]
        try:
            planned = plan(models[name], config, world_size, devices=devices)
        except ConfigError:
            continue  # settings the cell's own preparation refuses, and says why
        reduced = planned.communication["reduce_scatter"]
        if planned.mesh[1] == 1 or reduced < ACCUMULATION_BYTES:
            continue
        # FSDP2 keeps a gradient it does not reduce unsharded in the reduce dtype where that differs from the one
        # it computed in (``FSDPParam.to_accumulated_grad_if_needed``): 4 bytes a parameter under DEFAULT
        param_dtype, reduce_dtype = config.dtypes()[:2]
        kept = reduce_dtype or param_dtype
        unsharded = sum(
            p.numel() * (p.element_size() if kept is None else torch.empty((), dtype=kept).element_size())
            for p in {id(p): p for p in models[name].parameters() if p.requires_grad}.values()
        )
        extra = unsharded - planned.memory[0]["grads"]
        statement = _statement_of(backward, parents)
        sync = f"{name}.set_requires_gradient_sync({condition})  # reduce-scatter only before {step}"
        return [
            Finding(
                kind="accumulation",
                line=backward.lineno,
                text=cell.line(backward.lineno),
                what=f"{micro} backwards per {step} (line {_line_of(cell, step)}) without set_requires_gradient_sync: "
                f"each reduce-scatters {name}'s gradients, {size_text(reduced)} a rank (the planner's), "
                f"{micro} times a step where once would do",
                why="FSDP2 reduces the gradients at every backward unless told not to; told, it keeps them unsharded "
                + (
                    f"until the last micro-batch instead, {size_text(extra)} more a rank (the planner's unsharded "
                    "gradients, in the reduce dtype, less the sharded ones; at scale 4 bytes a parameter of the whole "
                    "model under DEFAULT): worth it while that fits, else keep the sync on"
                    if extra > 0
                    else "until the last micro-batch instead, at no more memory a rank by the planner's count"
                ),
                fix=f"{sync}\n{statement_text(cell.source, statement)}",
            )
        ]
    return []


def _accumulated(cell: CellCode, backward: ast.Call, parents: dict[int, ast.AST]) -> tuple | None:
    """(the loop of micro-batches, the step's text, the condition of the last micro-batch, how many per step)
    where ``backward`` runs several times per optimizer step; None where it runs once per step."""
    node: ast.AST = backward
    while id(node) in parents:
        node = parents[id(node)]
        if not isinstance(node, ast.For | ast.While):
            continue
        steps = [s for s in own_nodes(node) if isinstance(s, ast.Call) and _is_step(cell, s)]
        for step in steps:  # a step in the loop, under a condition the backward is not under: every k-th
            guard = _guard(step, node, parents)
            if guard is not None and backward not in list(ast.walk(guard)) and not cell.rank_dependent(guard.test):
                if _known_count(cell, _moduli(guard.test)) == 1:
                    return None  # every step: ``% 1``
                test = ast.get_source_segment(cell.source, guard.test) or ast.unparse(guard.test)
                return node, ast.unparse(step), test, _modulus(cell, guard.test)
        if steps:
            return None  # the step runs every iteration of this loop
        outer = _enclosing_loop(node, parents)
        if _known_count(cell, _counted(node)) == 1:
            continue  # one micro-batch: ``range(1)``, ``x.chunk(MICRO)`` with MICRO = 1
        if outer is not None and any(isinstance(s, ast.Call) and _is_step(cell, s) for s in own_nodes(outer)):
            step = next(s for s in own_nodes(outer) if isinstance(s, ast.Call) and _is_step(cell, s))
            return node, ast.unparse(step), _last_iteration(cell, node), _iterations(cell, node)
    return None


def _is_step(cell: CellCode, call: ast.Call) -> bool:
    base, _, attr = dotted(call.func).rpartition(".")
    return attr == "step" and base in cell.optimizers


def _guard(node: ast.AST, loop: ast.AST, parents: dict[int, ast.AST]) -> ast.If | None:
    while id(node) in parents and (node := parents[id(node)]) is not loop:
        if isinstance(node, ast.If):
            return node
    return None


def _enclosing_loop(node: ast.AST, parents: dict[int, ast.AST]) -> ast.AST | None:
    while id(node) in parents:
        node = parents[id(node)]
        if isinstance(node, ast.For | ast.While):
            return node
    return None


def _statement_of(node: ast.AST, parents: dict[int, ast.AST]) -> ast.stmt:
    while not isinstance(node, ast.stmt):
        node = parents[id(node)]
    return node


def _line_of(cell: CellCode, text: str) -> int:
    return next((i for i, line in enumerate(cell.lines, 1) if text in line), 0)


def _value(cell: CellCode, node: ast.AST) -> str:
    """A count as the cell writes it, with its value where the notebook holds it: ``K (4)``."""
    text = ast.unparse(node)
    value = cell.namespace.get(text) if isinstance(node, ast.Name) else None
    return f"{text} ({value})" if isinstance(value, int) else text


def _moduli(test: ast.AST) -> list[ast.AST]:
    return [n.right for n in ast.walk(test) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod)]


def _modulus(cell: CellCode, test: ast.AST) -> str:
    found = _moduli(test)
    return _value(cell, found[0]) if found else "several"


def _counted(loop: ast.AST) -> list[ast.AST]:
    """The count of ``for _ in range(N)`` or ``for part in x.chunk(N)`` / ``x.split(N)``: [N], else []."""
    if not (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call) and loop.iter.args):
        return []
    name = dotted(loop.iter.func)
    if name == "range" and len(loop.iter.args) == 1 or name.rpartition(".")[2] in ("chunk", "tensor_split"):
        return [loop.iter.args[0]]
    return []


def _known_count(cell: CellCode, counts: list[ast.AST]) -> int | None:
    """The first of ``counts`` as a number: a literal, or a name the notebook holds an int under."""
    if not counts:
        return None
    node = counts[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    value = cell.namespace.get(node.id) if isinstance(node, ast.Name) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _range_of(loop: ast.AST) -> tuple[str, ast.AST] | None:
    """(loop variable, N) of ``for i in range(N)``."""
    if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Call)):
        return None
    if dotted(loop.iter.func) == "range" and len(loop.iter.args) == 1:
        return loop.target.id, loop.iter.args[0]
    return None


def _iterations(cell: CellCode, loop: ast.AST) -> str:
    counted = _counted(loop)
    return _value(cell, counted[0]) if counted else "several"


def _last_iteration(cell: CellCode, loop: ast.AST) -> str:
    counted = _range_of(loop)
    return f"{counted[0]} == {ast.unparse(counted[1])} - 1" if counted else "last_micro_batch"
