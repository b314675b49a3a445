"""One measured figure against its target, as every benchmark reports it and the report prints it.

A measurement compares A (the reference: torchrun, raw ipyparallel) with B (nbfsdp) where there is a
reference, or reports B's value alone. ``value`` is what the target judges: a ratio, a latency, a fraction.
Samples are per-round figures (a round runs A and B, in ``in_turn``'s order), so their medians are the
medians of per-round medians; ``ok`` is None when the figure could not be measured (``note`` says why).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

#: How a target judges a value: at most, at least, or within a relative band around 1.
OPS = ("<=", ">=", "±")


def in_turn(a: Any, b: Any, round_index: int) -> tuple[Any, Any]:
    """A round's order: A then B in even rounds, B then A in odd ones, so neither always runs after the other."""
    return (b, a) if round_index % 2 else (a, b)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass
class Measurement:
    what: str
    value: float | None
    unit: str
    """How ``value`` reads: ``x`` (a ratio), ``ms``, ``s``, ``%``."""
    target: float | None = None
    op: str | None = None
    a_label: str = ""
    a: float | None = None
    b_label: str = ""
    b: float | None = None
    ab_unit: str = ""
    """Unit of ``a`` and ``b`` (``ms``, ``s``, ``MiB`` ...)."""
    samples_a: list[Any] = field(default_factory=list)
    samples_b: list[Any] = field(default_factory=list)
    samples_value: list[Any] = field(default_factory=list)
    note: str = ""

    def __post_init__(self) -> None:
        assert self.op is None or self.op in OPS, self.op

    @property
    def ok(self) -> bool | None:
        if self.value is None or math.isnan(self.value):
            return None
        if self.op is None or self.target is None:
            return None
        if self.op == "<=":
            return self.value <= self.target
        if self.op == ">=":
            return self.value >= self.target
        return abs(self.value - 1.0) <= self.target

    @property
    def target_text(self) -> str:
        if self.op is None or self.target is None:
            return ""
        if self.op == "±":
            return f"within {self.target * 100:g}% of 1x"
        return f"{'≤' if self.op == '<=' else '≥'} {format_value(self.target, self.unit)}"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "target_text": self.target_text}


def format_value(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "x":
        return f"{value:.3f}x"
    if unit == "%":
        return f"{value:+.2f}%" if value else "0%"
    if unit in ("ms", "s", "MiB"):
        return f"{value:.1f} {unit}" if abs(value) < 1000 else f"{value:.0f} {unit}"
    if unit == "":
        return f"{value:.3g}"
    return f"{value:.3g} {unit}"
