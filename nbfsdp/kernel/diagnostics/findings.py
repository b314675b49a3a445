"""One thing the check found (``check``): where, what, why and the fix as code."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass


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
