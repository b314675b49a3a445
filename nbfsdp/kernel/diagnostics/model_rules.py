"""The check's rules on the notebook's models: tied weights a wrap rule splits across units, a unit whose
trainable parameters mix dtypes, and bf16 asked of GPUs without it."""

from __future__ import annotations

import ast
import re

import torch
import torch.nn as nn

from nbfsdp.kernel.diagnostics.cell_code import CellCode
from nbfsdp.kernel.diagnostics.findings import Finding
from nbfsdp.shared.config import ConfigError, FSDPConfig
from nbfsdp.shared.devices import BF16_CAPABILITY, Devices
from nbfsdp.shared.units import dtype_splits, ties_kept, wrap_rule

_TIE = re.compile(r"^(?P<names>.+?) are one tied parameter, but (?P<apart>.+?) is a unit of its own")
_MIXED = re.compile(
    r"^(?P<module>\S+|the root) \((?P<cls>\w+)\) holds trainable parameters stored in (?P<dtypes>.+?) in"
)
_SPLIT = re.compile(r"^(?P<unit>.+?) is split by dtype: its trainable parameters are stored in (?P<dtypes>.+?), and")


def units(cell: CellCode, name: str, model: nn.Module, config: FSDPConfig) -> list[Finding]:
    """Tied weights a rule splits across units (FSDP2 refuses them), and units whose trainable parameters mix
    dtypes (split into more units by nbfsdp, or refused), as the ranks will choose the units."""
    line = cell.first_use(name)
    try:
        ties_kept(model, config)
    except ConfigError as error:
        if (tie := _TIE.match(str(error))) is None:
            return []  # another refusal (a container made a unit): the cell's own preparation says it
        return [_tie_finding(cell, name, model, config, line=line, tie=tie)]
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
    cell: CellCode, name: str, model: nn.Module, config: FSDPConfig, *, line: int, tie: re.Match
) -> Finding:
    """The refusal ``tie`` matched (its ``string``: the whole message), as a finding with its fix."""
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
        f"parent's, {tie.string.rpartition('stays in ')[2] or 'the root'})",
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


_NO_BF16 = (
    "GPUs below compute capability {} have no bf16 tensor cores: bf16 is emulated there, slow, and a source of NaNs"
)


def bf16(cell: CellCode, config: FSDPConfig, devices: Devices) -> list[Finding]:
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
