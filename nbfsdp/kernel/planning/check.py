"""The check before a cell's first step: ``%fsdp check``, and by itself before each new ``%%fsdp`` cell.

It looks for what would hang the cell, fail it, or train the wrong thing without a word: a rank-dependent
branch around a collective (every sharded forward is one), tied weights a rule splits across units, a unit
whose trainable parameters mix dtypes, bf16 asked of GPUs without it, an optimizer over parameters the cell
does not shard, and gradient accumulation that reduce-scatters every micro-batch. Each finding names the
cell's line and gives the fix as code. Pure analysis, in the kernel: the cell's syntax tree
(``cell_code``), the notebook's models with the units the ranks will choose (``nbfsdp.shared.units``) and the
planner's bytes (``plans.plan``); nothing runs. Before a cell it prints only what it finds, once per
cell source, settings and models, and never refuses the cell.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.optim import Optimizer

from nbfsdp.kernel.planning.cell_code import SYNC_SETTINGS, Call, CellCode, dotted, own_nodes, statement_text
from nbfsdp.kernel.planning.plans import plan
from nbfsdp.shared import transfer
from nbfsdp.shared.collectives import size_text
from nbfsdp.shared.config import ConfigError, FSDPConfig
from nbfsdp.shared.devices import BF16_CAPABILITY, Devices
from nbfsdp.shared.protocol import InternalRequest
from nbfsdp.shared.units import dtype_splits, ties_kept, wrap_rule

#: Gradient accumulation without ``set_requires_gradient_sync`` is a finding from this many bytes of gradients
#: reduce-scattered a micro-batch (the planner's): below it a collective's cost is its latency, not its bytes,
#: and the extra reduce-scatters are cheap.
ACCUMULATION_BYTES = 2**20


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the check found: where, what, why (one sentence) and the fix as code."""

    kind: str
    """``rank-branch``, ``tied-weights``, ``mixed-dtypes``, ``bf16``, ``optimizer`` or ``accumulation``."""
    line: int
    """The cell's line (1 is the first line after ``%%fsdp``); 0: the ``%%fsdp`` line's settings."""
    text: str
    """That line, as written (for 0: the settings in question)."""
    what: str
    why: str
    fix: str
    """Code to paste: the line(s) to write instead."""

    def __str__(self) -> str:
        where = "the %%fsdp line" if self.line == 0 else f"line {self.line}"
        return "\n".join(
            [
                f"nbfsdp check: {where}: {self.text.strip()}",
                f"    {self.what}",
                f"    Why: {self.why}",
                "    Fix:",
                textwrap.indent(self.fix, " " * 8),
            ]
        )


class CheckedCell(Protocol):
    """What the check needs of a cell that ran (``nbfsdp.kernel.run.history.LastCell``)."""

    code: str
    world_size: int
    config: FSDPConfig
    devices: Devices


def check(code: str, namespace: dict[str, Any], config: FSDPConfig, world_size: int, devices: Devices) -> list[Finding]:
    """Every finding of the cell ``code`` (without its ``%%fsdp`` line), with the notebook's ``namespace``, under
    ``config`` (validated for ``devices``) at ``world_size``, in the cell's line order."""
    models = _models(code, namespace)
    cell = CellCode(code, namespace, list(models))
    findings = [
        *_rank_branches(cell),
        *(f for name, model in models.items() for f in _units(cell, name, model, config)),
        *_bf16(cell, config, devices),
        *_optimizers(cell, models),
        *_accumulation(cell, models, config, world_size, devices),
    ]
    return sorted(findings, key=lambda f: f.line)


def report(findings: list[Finding]) -> str:
    return "\n".join(map(str, findings))


def last_cell(cell: CheckedCell | None, namespace: dict[str, Any]) -> str:
    """``%fsdp check``: the last ``%%fsdp`` cell checked again, against the notebook as it is now."""
    if cell is None:
        raise ConfigError(
            "%fsdp check checks the last %%fsdp cell, and none has run yet (each %%fsdp cell is checked by "
            "itself before its first step)"
        )
    found = check(cell.code, namespace, cell.config, cell.world_size, cell.devices)
    return report(found) if found else f"nbfsdp check: nothing found in the last %%fsdp cell ({CHECKED_FOR})"


#: What the check looks for, in words.
CHECKED_FOR = "rank-dependent branches, tied weights, dtypes, bf16, optimizers, gradient accumulation"
#: The cells checked before they ran: the findings of one cell are printed once, not at every re-run.
_CHECKED: set[tuple] = set()


def before_cell(
    code: str | InternalRequest, namespace: dict[str, Any], config: FSDPConfig, world_size: int, devices: Devices
) -> None:
    """Before a cell's first step: print its findings (on stderr), once per cell source, settings and models.
    nbfsdp's own cells (a typed request) are not checked."""
    if not isinstance(code, str):
        return
    try:
        models = _models(code, namespace)
    except SyntaxError:
        return  # the cell's own parse reports it
    key = (code, world_size, repr(config.as_dict()), str(devices), tuple(map(id, models.values())))
    if key in _CHECKED:
        return
    _CHECKED.add(key)
    found = check(code, namespace, config, world_size, devices)
    if found:
        print(report(found), file=sys.stderr)


def _models(code: str, namespace: dict[str, Any]) -> dict[str, nn.Module]:
    """The notebook's models the cell reads (each once): the ones nbfsdp shards."""
    reads, _ = transfer.analyze_cell(ast.parse(code))
    models: dict[str, nn.Module] = {}
    for name in reads:
        value = namespace.get(name)
        if isinstance(value, nn.Module) and transfer.is_model(value) and all(value is not m for m in models.values()):
            models[name] = value
    return models


# ------------------------------------------------------------------ rank-dependent branches
_HANG = (
    "every rank must join a collective, and a sharded model's forward all-gathers each unit's parameters, its "
    "backward reduce-scatters the gradients: the other ranks never join, and the cell hangs until --timeout"
)
_HALF_STEP = (
    "each rank's optimizer steps only its own shard of the parameters: the other ranks' rows keep their old "
    "values, and the model comes back half updated"
)


def _rank_branches(cell: CellCode) -> list[Finding]:
    findings: list[Finding] = []
    flagged: list[range] = []
    for node in ast.walk(cell.tree):
        if not isinstance(node, ast.If) or not cell.rank_dependent(node.test):
            continue
        if any(node.lineno in lines for lines in flagged):
            continue  # inside a branch said already
        body = [c for s in node.body for c in cell.collectives(s)]
        other = [c for s in node.orelse for c in cell.collectives(s)]
        elif_ = len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If)  # its own test is checked on its own
        for side, calls, against in (("body", body, other), ("orelse", other, body)):
            extra = [c for c in calls if c.kind not in {a.kind for a in against}]
            if not extra or (side == "orelse" and elif_):
                continue
            findings.append(_rank_finding(cell, node, side, extra))
            branch = node.body if side == "body" else node.orelse
            flagged.append(range(branch[0].lineno, (branch[-1].end_lineno or branch[-1].lineno) + 1))
    return findings


def _rank_finding(cell: CellCode, node: ast.If, side: str, extra: list[Call]) -> Finding:
    test = ast.get_source_segment(cell.source, node.test) or ast.unparse(node.test)
    condition = test if side == "body" else f"not ({test})"
    calls = ", ".join(dict.fromkeys(f"{c.kind}{f' in {c.via}' if c.via else ''} (line {c.line})" for c in extra))
    kinds = {c.kind for c in extra}
    branch = node.body if side == "body" else node.orelse
    moved = [s for s in branch if {c.kind for c in cell.collectives(s)} & kinds]
    kept = [s for s in branch if s not in moved]
    fix = ["# every rank runs these:", *(statement_text(cell.source, s) for s in moved)]
    body, orelse = (kept, node.orelse) if side == "body" else (node.body, kept)
    if body:
        fix += [f"if {test}:", *_indented(cell, body)]
        fix += ["else:", *_indented(cell, orelse)] if orelse else []
    elif orelse:
        fix += [f"if not ({test}):", *_indented(cell, orelse)]
    steps_only = all(c.kind.endswith(".step()") for c in extra)
    return Finding(
        kind="rank-branch",
        line=node.lineno,
        text=cell.line(node.lineno),
        what=f"{calls} {'runs' if len(extra) == 1 else 'run'} only on the ranks where `{condition}` holds",
        why=_HALF_STEP if steps_only else _HANG,
        fix="\n".join(fix),
    )


def _indented(cell: CellCode, statements: list[ast.stmt]) -> list[str]:
    return [textwrap.indent(statement_text(cell.source, s), "    ") for s in statements]


# ------------------------------------------------------------------ units: ties and dtypes
_TIE = re.compile(r"^(?P<names>.+?) are one tied parameter, but (?P<apart>.+?) is a unit of its own")
_MIXED = re.compile(
    r"^(?P<module>\S+|the root) \((?P<cls>\w+)\) holds trainable parameters stored in (?P<dtypes>.+?) in"
)
_SPLIT = re.compile(r"^(?P<unit>.+?) is split by dtype: its trainable parameters are stored in (?P<dtypes>.+?), and")


def _units(cell: CellCode, name: str, model: nn.Module, config: FSDPConfig) -> list[Finding]:
    """Tied weights a rule splits across units (FSDP2 refuses them), and units whose trainable parameters mix
    dtypes (split into more units by nbfsdp, or refused), as the ranks will choose the units."""
    line = cell.first_use(name)
    try:
        ties_kept(model, config)
    except ConfigError as error:
        if (tie := _TIE.match(str(error))) is None:
            return []  # another refusal (a container made a unit): the cell's own preparation says it
        return [_tie_finding(cell, name, model, config, line, tie, str(error))]
    try:
        splits = dtype_splits(model, config)
    except ConfigError as error:
        if (mixed := _MIXED.match(str(error))) is None:
            return []
        module = _path("" if mixed["module"] == "the root" else mixed["module"])
        return [
            Finding(
                kind="mixed-dtypes",
                line=line,
                text=cell.line(line),
                what=f"{name}{module} ({mixed['cls']}) holds trainable parameters stored in {mixed['dtypes']}, in "
                "one FSDP unit: the cell is refused before it runs",
                why="FSDP2 all-gathers a unit's parameters as one tensor and needs one dtype among its trainable "
                "ones (pytorch#156784), and no split by module can separate parameters of one module",
                fix=f"{name}{module}.to({_main_dtype(model)})  # in the notebook, before the cell: one dtype\n"
                f"# or freeze the odd ones: {name}{module}.<param>.requires_grad_(False)",
            )
        ]
    return [_split_finding(cell, name, model, line, note) for note in splits if _SPLIT.match(note)]


def _tie_finding(
    cell: CellCode, name: str, model: nn.Module, config: FSDPConfig, line: int, tie: re.Match, message: str
) -> Finding:
    apart = [path.strip() for path in tie["apart"].split(",")]
    rule = wrap_rule(model, config)
    if "wrap_cls" in rule.sources:
        classes = {type(model.get_submodule(path)).__name__ for path in apart}
        left = [c for c in config.wrap_cls if c not in classes]
        fix = f"%%fsdp --wrap-cls {','.join(left)}" if left else "%%fsdp  # without --wrap-cls"
        text = f"--wrap-cls {','.join(config.wrap_cls)}"
    else:
        fix = "\n".join(f"{name}{_path(path)}._fsdp_wrap = False  # in the notebook, before the cell" for path in apart)
        text = cell.line(line)
    return Finding(
        kind="tied-weights",
        line=0 if "wrap_cls" in rule.sources else line,
        text=text,
        what=f"{name}: {tie['names']} are one tied parameter, and the rule ({rule}) makes {', '.join(apart)} a "
        "unit of its own, apart from the tie's other name: the cell is refused before it runs",
        why="FSDP2 shards each parameter in exactly one unit, so a tie must stay inside one unit (the common "
        f"parent's, {message.rpartition('stays in ')[2] or 'the root'})",
        fix=fix,
    )


def _split_finding(cell: CellCode, name: str, model: nn.Module, line: int, note: str) -> Finding:
    split = _SPLIT.match(note)
    assert split is not None
    modules = note.rpartition("; ")[2].split(" (")[0]
    main = _main_dtype(model)
    fix = "\n".join(f"{name}{_path(path.strip())}.to({main})" for path in modules.split(","))
    return Finding(
        kind="mixed-dtypes",
        line=line,
        text=cell.line(line),
        what=f"{name}: {note}",
        why="FSDP2 needs one dtype among a unit's trainable parameters (pytorch#156784), so nbfsdp makes each odd "
        "module a unit of its own: each costs an all-gather in forward and backward and a reduce-scatter a step",
        fix=f"# in the notebook, before the cell, if one dtype suits them (else leave the split to nbfsdp):\n{fix}",
    )


def _path(path: str) -> str:
    """A module's path as Python reaches it: ``blocks.1.norm`` is ``.blocks[1].norm``."""
    return "".join(f"[{part}]" if part.isdigit() else f".{part}" for part in path.split(".") if part)


def _main_dtype(model: nn.Module) -> str:
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return str(max(counts, key=lambda d: counts[d], default=torch.float32))


# ------------------------------------------------------------------ bf16 on GPUs without it
_NO_BF16 = (
    "GPUs below compute capability {} have no bf16 tensor cores: bf16 is emulated there, slow, and a source of NaNs"
)


def _bf16(cell: CellCode, config: FSDPConfig, devices: Devices) -> list[Finding]:
    capability = devices.capability
    if devices.type != "cuda" or capability is None or tuple(capability) >= BF16_CAPABILITY:
        return []
    why = _NO_BF16.format(".".join(map(str, BF16_CAPABILITY))) + f" (these are {capability[0]}.{capability[1]})"
    findings = []
    if torch.bfloat16 in config.dtypes():
        asked = isinstance(config.mixed_precision, dict)
        findings.append(
            Finding(
                kind="bf16",
                line=0,
                text="--config ... mixed_precision" if asked else f"--precision {config.precision}",
                what=f"bf16 asked ({'a mixed_precision dict' if asked else '--precision bf16'}) on GPUs without it",
                why=why,
                fix="%%fsdp --precision fp16  # or no --precision: nbfsdp picks fp16 here and scales the losses",
            )
        )
    lines = sorted({n.lineno for n in ast.walk(cell.tree) if isinstance(n, ast.Attribute) and n.attr == "bfloat16"})
    for line in lines:
        findings.append(
            Finding(
                kind="bf16",
                line=line,
                text=cell.line(line),
                what="the cell computes in bf16 on GPUs without it",
                why=why,
                fix=cell.line(line).strip().replace("bfloat16", "float16")
                + "  # fp16: scale the loss (torch.amp.GradScaler)",
            )
        )
    return findings


# ------------------------------------------------------------------ optimizers over what the cell does not shard
_UNSHARDED = (
    "nbfsdp shards only the models a cell reads, and an optimizer must hold their sharded parameters: these go "
    "to each rank as a plain copy, so the steps change that copy and the model the cell trains is never stepped"
)


def _optimizers(cell: CellCode, models: dict[str, nn.Module]) -> list[Finding]:
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


# ------------------------------------------------------------------ gradient accumulation without no_sync
def _accumulation(
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
