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
import sys
from typing import Any, Protocol

import torch.nn as nn

from nbfsdp.kernel.diagnostics import accumulation, model_rules, optimizer_rules, rank_branches
from nbfsdp.kernel.diagnostics.cell_code import CellCode
from nbfsdp.kernel.diagnostics.findings import Finding
from nbfsdp.shared import transfer
from nbfsdp.shared.config import ConfigError, FSDPConfig
from nbfsdp.shared.devices import Devices
from nbfsdp.shared.protocol import InternalRequest


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
        *rank_branches.findings(cell),
        *(f for name, model in models.items() for f in model_rules.units(cell, name, model, config)),
        *model_rules.bf16(cell, config, devices),
        *optimizer_rules.findings(cell, models),
        *accumulation.findings(cell, models, config, world_size, devices),
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
