"""The check's rank-dependent branches: an ``if`` on the rank around a collective (every sharded forward is one)
hangs the cell; around an optimizer step, it trains half the model. Read from the cell's syntax tree."""

from __future__ import annotations

import ast
import textwrap

from nbfsdp.kernel.diagnostics.cell_code import Call, CellCode, statement_text
from nbfsdp.kernel.diagnostics.findings import Finding

_HANG = (
    "every rank must join a collective, and a sharded model's forward all-gathers each unit's parameters, its "
    "backward reduce-scatters the gradients: the other ranks never join, and the cell hangs until --timeout"
)
_HALF_STEP = (
    "each rank's optimizer steps only its own shard of the parameters: the other ranks' rows keep their old "
    "values, and the model comes back half updated"
)


def findings(cell: CellCode) -> list[Finding]:
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
