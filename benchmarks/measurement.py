"""One measured figure against its target, as every benchmark reports it and the report prints it.

A measurement compares A (the reference: torchrun, raw ipyparallel) with B (nbfsdp) where there is a
reference, or reports B's value alone. ``value`` is what the target judges: a ratio, a latency, a fraction.
Samples are per-round figures (a round runs A and B, in ``in_turn``'s order), so their medians are the
medians of per-round medians; ``ok`` is None when the figure could not be measured (``note`` says why).
Where a figure comes from rounds, ``interval`` is its 95% bootstrap interval over those rounds: on a noisy
machine a figure can sit on one side of its target while the rounds cannot tell which side it belongs on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from scipy.stats import bootstrap

#: How a target judges a value: at most, at least, or within a relative band around 1.
OPS = ("<=", ">=", "±")


def in_turn(a: Any, b: Any, round_index: int) -> tuple[Any, Any]:
    """A round's order: A then B in even rounds, B then A in odd ones, so neither always runs after the other."""
    return (b, a) if round_index % 2 else (a, b)


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


#: Resamples behind an interval, and their seed: the same rounds always give the same interval.
BOOTSTRAP_RESAMPLES = 4000
BOOTSTRAP_SEED = 0
#: Fewer rounds resample into a handful of distinct figures, not an interval (``--quick`` runs two).
MIN_ROUNDS_FOR_INTERVAL = 5


def round_interval(
    a: Sequence[float], b: Sequence[float], statistic: Callable[[Sequence[float], Sequence[float]], float]
) -> tuple[float, float] | None:
    """95% percentile-bootstrap interval of ``statistic(a, b)``, resampling whole rounds: a round's A and B
    stay together, since they ran back to back on the same state of the machine. None for too few rounds."""
    if len(a) < MIN_ROUNDS_FOR_INTERVAL:
        return None
    result = bootstrap(
        (np.asarray(a, dtype=float), np.asarray(b, dtype=float)),
        lambda x, y: statistic(list(x), list(y)),
        paired=True,
        vectorized=False,
        n_resamples=BOOTSTRAP_RESAMPLES,
        confidence_level=0.95,
        method="percentile",  # BCa needs more rounds than a benchmark runs (8 to 20)
        rng=np.random.default_rng(BOOTSTRAP_SEED),
    )
    low, high = result.confidence_interval
    return float(low), float(high)


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
    interval: tuple[float, float] | None = None
    """95% bootstrap interval of ``value`` over the rounds (``round_interval``), where rounds made it."""
    note: str = ""

    def __post_init__(self) -> None:
        assert self.op is None or self.op in OPS, self.op

    @classmethod
    def compared(
        cls,
        what: str,
        statistic: Callable[[Sequence[float], Sequence[float]], float],
        a: tuple[str, list[float]],
        b: tuple[str, list[float]],
        **rest: Any,
    ) -> Measurement:
        """A row judging ``statistic(A, B)`` over rounds of both (``a`` and ``b``: a label and per-round figures):
        each side's median, its samples and the rounds' interval filled in; ``rest``: the other fields."""
        (a_label, samples_a), (b_label, samples_b) = a, b
        return cls(
            what=what,
            value=statistic(samples_a, samples_b),
            a_label=a_label,
            a=median(samples_a),
            b_label=b_label,
            b=median(samples_b),
            samples_a=samples_a,
            samples_b=samples_b,
            interval=round_interval(samples_a, samples_b, statistic),
            **rest,
        )

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
    def interval_spans_target(self) -> bool | None:
        """Whether the rounds leave it open which side of the target the figure is on (None: no interval)."""
        if self.interval is None or self.ok is None:
            return None
        low, high = self.interval
        if self.op == "±":  # the target is a band around 1: the interval must lie wholly in it or outside it
            inside = 1.0 - self.target <= low and high <= 1.0 + self.target
            outside = high < 1.0 - self.target or low > 1.0 + self.target
            return not (inside or outside)
        return low <= self.target <= high

    @property
    def target_text(self) -> str:
        if self.op is None or self.target is None:
            return ""
        if self.op == "±":
            return f"within {self.target * 100:g}% of 1x"
        return f"{'≤' if self.op == '<=' else '≥'} {format_value(self.target, self.unit)}"

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "ok": self.ok,
            "interval_spans_target": self.interval_spans_target,
            "target_text": self.target_text,
        }


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
