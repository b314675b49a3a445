"""The lines a learner would type at a prompt, typed for them (the notebook): under nbval, or "Run all", no one
answers the debugger's prompts (``%debug``, a ``breakpoint()`` in a ``%%fsdp`` cell), so a course cell gives the
lines here and its output shows the session as it would go. Typed by hand, the same lines give the same output."""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def typed(lines: list[str]) -> Iterator[None]:
    """Within the block, each ``input(prompt)`` (where pdb asks, in the notebook) answers the next of ``lines``,
    shown after its prompt as it would be typed. ipykernel sets ``builtins.input`` for each cell; it is put back
    after the block."""
    answers = iter(lines)

    def answer(prompt: object = "") -> str:
        line = next(answers)
        print(f"{prompt}{line}")
        return line

    ipykernels = builtins.input
    builtins.input = answer
    try:
        yield
    finally:
        builtins.input = ipykernels
